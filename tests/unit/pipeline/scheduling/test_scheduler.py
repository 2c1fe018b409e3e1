"""The scheduler as plain CPU logic: budget, packing, continuous refill, best_of rows."""

from pipeline.scheduling.scheduler import Group, Scheduler, SchedulerConfig, ServePolicy


def drain(s: Scheduler, lengths_of: dict[int, int], max_steps: int = 10_000) -> list[int]:
    """Simulate: every pass finishes rows whose group has produced its max_tokens. Returns finish order."""
    produced: dict[tuple[int, int], int] = {}
    order, steps = [], 0
    while not s.idle():
        steps += 1
        assert steps < max_steps, "scheduler stalled"
        ran = False
        for slot in s.slots:
            if slot.fed:
                continue
            ps = s.next_pass(slot.sid)
            if ps is None:
                continue
            ran = True
            # the KV budget holds (slots and prefix pool), and the slot's cache holds each of its groups
            assert s.used <= s.budget, f"{s.used} KV cells in use over the budget of {s.budget}"
            assert all(s.cells(s.groups[g]) // s.groups[g].width <= slot.cols for g in slot.row_group if g is not None)
            live = set(ps.decode_rows) | {r for rows in ps.rows_of.values() for r in rows}
            cont, fin = [], []
            for r in live:
                gid = slot.row_group[r]
                produced[(slot.sid, r)] = produced.get((slot.sid, r), 0) + 1 if r in ps.decode_rows else 1
                if produced[(slot.sid, r)] >= lengths_of[gid]:
                    fin.append(r)
                    produced.pop((slot.sid, r))
                    if gid not in order and all(slot.row_group[x] != gid for x in live if x not in fin):
                        order.append(gid)
                else:
                    cont.append(r)
            s.on_reply(slot.sid, cont, fin)
        assert ran or s.idle(), "nothing ran although work is queued"
    return order


def test_everything_runs_under_a_small_budget():
    s = Scheduler(SchedulerConfig(budget=64, num_slots=2, max_rows=4))
    lengths = {}
    for gid in range(30):
        g = Group(gid, prompt_len=5 + gid % 7, max_tokens=1 + gid % 5)
        lengths[gid] = g.max_tokens
        s.submit(g)
    done = drain(s, lengths)
    assert sorted(done) == list(range(30))


def test_budget_is_never_exceeded_and_similar_lengths_pack_together():
    s = Scheduler(SchedulerConfig(budget=400, num_slots=1, max_rows=8))
    for gid, need in enumerate([10, 200, 11, 12, 190, 10]):
        s.submit(Group(gid, prompt_len=need - 2, max_tokens=2))
    ps = s.next_pass(0)
    slot = s.slots[0]
    assert slot.rows * slot.cols <= 400
    packed = {slot.row_group[r] for r in range(slot.rows)}
    assert packed == {0, 2, 3, 5}  # the short ones, not the 200-token ones
    assert ps.alloc == (4, 12)


def test_finished_rows_are_refilled_while_others_continue():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=2))
    for gid in range(3):
        s.submit(Group(gid, prompt_len=4, max_tokens=8))
    s.next_pass(0)
    assert s.slots[0].rows == 2 and len(s.queue) == 1
    s.on_reply(0, continuing=[1], finished=[0])  # group 0 stopped early (a stop string)
    ps = s.next_pass(0)
    assert ps.alloc is None  # same micro-batch, no reallocation
    assert list(ps.decode_rows) == [1] and ps.prefill == [(2, 0)]


def test_best_of_rows_share_one_prefill():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=8))
    s.submit(Group(0, prompt_len=6, max_tokens=3, width=4))
    ps = s.next_pass(0)
    assert ps.prefill == [(0, 0)] and ps.forks == ((0, (1, 2, 3), 6),)  # the prompt's 6 columns


def test_wide_group_runs_alone_and_oversized_groups_are_refused():
    s = Scheduler(SchedulerConfig(budget=100, num_slots=1, max_rows=2))
    assert s.fits(Group(0, 10, 10, width=4))
    assert not s.fits(Group(1, 90, 20))
    s.submit(Group(0, 10, 10, width=4))
    assert s.next_pass(0).alloc == (4, 20)


def test_long_request_is_not_starved_by_refills():
    s = Scheduler(SchedulerConfig(budget=100, num_slots=2, max_rows=4))
    s.submit(Group(0, 8, 2))
    s.next_pass(0)
    s.submit(Group(1, 60, 30))  # needs 90 cells: must wait until slot 0 drains
    for gid in range(2, 20):
        s.submit(Group(gid, 8, 2))
    s.on_reply(0, continuing=[], finished=[0])
    assert s.slots[0].rows == 0
    ps = s.next_pass(1)
    assert ps is not None and s.slots[1].cols == 90


def _two_busy_slots(headroom: bool) -> Scheduler:
    """Two micro-batches of 4 short rows (prompt 10, max_tokens 10); slot 0 then has 1 free row, slot 1 two."""
    s = Scheduler(SchedulerConfig(budget=200, num_slots=2, max_rows=4), policy=ServePolicy() if headroom else None)
    for gid in range(8):
        s.submit(Group(gid, 10, 10))
    for sid, done in ((0, 1), (1, 2)):
        ps = s.next_pass(sid)
        rows = [r for rows in ps.rows_of.values() for r in rows]
        s.on_reply(sid, rows[done:], rows[:done])
    return s


def test_serve_mode_drains_one_micro_batch_for_a_long_request():
    """A request longer than every micro-batch: file mode stops every refill until slots drain; serve
    mode drains only the emptiest slot, which still takes requests that end before its own rows do."""
    lengths = {gid: 10 for gid in range(8)}
    for headroom in (False, True):
        s = _two_busy_slots(headroom)
        assert all(slot.cols < 70 for slot in s.slots)
        s.submit(Group(100, 60, 10))  # needs 70 columns: fits no running micro-batch, nor the free budget
        s.submit(Group(101, 10, 10))
        s.submit(Group(102, 10, 3))
        first, second = s.next_pass(0), s.next_pass(1)
        if not headroom:
            assert first.admitted == () and second.admitted == ()
        else:
            assert [g for g, _ in first.admitted] == [101]  # slot 0 keeps taking requests
            assert s.policy.draining == 1 and [g for g, _ in second.admitted] == [102]  # slot 1 drains: only a 3-token request joins
        for sid, ps in ((0, first), (1, second)):
            rows = sorted(set(ps.decode_rows) | {r for rows in ps.rows_of.values() for r in rows})
            s.on_reply(sid, rows, [])
        lengths.update({100: 10, 101: 10, 102: 3})
        produced = {}
        done = drain_from(s, lengths, produced)
        assert sorted(done) == [1, 2, 3, 6, 7, 100, 101, 102]  # every one ends (no stall), each once


def drain_from(s: Scheduler, lengths_of: dict[int, int], produced: dict) -> list[int]:
    """Like :func:`drain`, for a scheduler with passes already run (rows count from their next token)."""
    for slot in s.slots:
        for r, gid in enumerate(slot.row_group):
            if gid is not None:
                produced[(slot.sid, r)] = 2  # prefill + one decode step ran
    order, steps = [], 0
    while not s.idle():
        steps += 1
        assert steps < 1000, "scheduler stalled"
        for slot in s.slots:
            ps = None if slot.fed else s.next_pass(slot.sid)
            if ps is None:
                continue
            cont, fin = [], []
            for r in sorted(set(ps.decode_rows) | {r for rows in ps.rows_of.values() for r in rows}):
                gid = slot.row_group[r]
                produced[(slot.sid, r)] = produced.get((slot.sid, r), 0) + 1
                if produced[(slot.sid, r)] >= lengths_of[gid]:
                    fin.append(r)
                    produced.pop((slot.sid, r))
                    order.append(gid)
                else:
                    cont.append(r)
            s.on_reply(slot.sid, cont, fin)
    return order


def test_serve_mode_prefix_pool_yields_to_a_new_micro_batch():
    """A pool grown while traffic was light must not leave a new micro-batch a sliver of the budget."""
    from pipeline.cache.prefix import PrefixCache

    s = Scheduler(SchedulerConfig(budget=400, num_slots=2, max_rows=4), prefix=PrefixCache(4, 400), policy=ServePolicy())
    s.prefix.capacity = s.prefix.max_blocks  # 200 cells, grown earlier
    for gid in range(8):
        s.submit(Group(gid, 10, 10))
    a = s.next_pass(0)
    assert a.alloc[0] * a.alloc[1] <= 200 and s.prefix.cells == 200
    b = s.next_pass(1)
    assert s.prefix.cells == 0 and b.alloc[0] == 4  # the pool was dropped, the slot got its share


def test_serve_mode_one_micro_batch_keeps_its_prefix_pool_between_requests():
    """P = 1 serves with one micro-batch: it sizes its free rows to what the pool leaves at its largest
    (it took the whole budget: the pool never grew), and a request arriving alone keeps the pool and
    finds its prefix there (the pool used to yield to a share of the whole budget)."""
    from pipeline.cache.prefix import PrefixCache

    s = Scheduler(SchedulerConfig(budget=400, num_slots=1, max_rows=4), prefix=PrefixCache(4, 400), policy=ServePolicy())
    s.submit(Group(0, 10, 10))
    alloc = s.next_pass(0).alloc
    assert alloc[0] * alloc[1] <= 200 and s.slot_share == 200
    s = Scheduler(SchedulerConfig(budget=400, num_slots=1, max_rows=4), prefix=PrefixCache(4, 400), policy=ServePolicy())
    s.prefix.capacity = s.prefix.max_blocks  # 200 cells, holding earlier requests' blocks
    s.submit(Group(0, 10, 10))
    assert s.next_pass(0).alloc and s.prefix.cells == 200
    s.submit(Group(1, 150, 100))  # needs more than the pool leaves: the pool gives way
    s.on_reply(0, [], [0])
    assert s.next_pass(0).alloc and s.prefix.cells == 0


def test_a_chunked_prompt_resumes_in_its_slots_next_passes_then_decodes():
    """Chunks of 40: a row whose prompt is not all computed is resumed (``Pass.resume``) by the slot's
    next passes, samples nothing in between, and decodes once its last chunk is in; each pass says
    where its part of each prompt ends."""
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=4, chunk=40))
    s.submit(Group(0, prompt_len=100, max_tokens=3, chunkable=True))
    s.submit(Group(1, prompt_len=10, max_tokens=3))
    ps = s.next_pass(0)
    assert [g for g, _ in ps.prefill] == [0, 1] and ps.resume == {}
    assert [(p.cached, p.end, p.partial) for p in ps.prompts] == [(0, 40, True), (0, 10, False)]
    row0, row1 = ps.rows_of[0][0], ps.rows_of[1][0]
    s.on_reply(0, [row1], [])  # only the whole prompt sampled a token
    ps = s.next_pass(0)
    assert ps.decode_rows == (row1,) and ps.prefill == [(0, row0)] and ps.resume == {row0: 40}
    assert ps.admitted == () and ps.prompts[0].resumed  # a resumed prompt is not admitted again
    s.on_reply(0, [row1], [])
    ps = s.next_pass(0)
    assert ps.resume == {row0: 80} and ps.prompts[0].end == 100  # its last chunk: it samples, then decodes
    s.on_reply(0, [row0, row1], [])
    ps = s.next_pass(0)
    assert ps.prefill == [] and ps.resume == {} and sorted(ps.decode_rows) == sorted([row0, row1])
    assert ps.column(row0) == 100


def test_a_pass_computes_at_most_its_prefill_tokens_chunks_included():
    """With chunked prompts a pass counts each prompt's chunk, not its whole length, and the chunks it
    continues: at most ``prefill_tokens`` (rows x the longest), the oldest chunked prompts first, so
    passes stay even (a pipeline's stages wait on the longest); every prompt still completes."""
    s = Scheduler(SchedulerConfig(budget=100_000, num_slots=1, max_rows=16, chunk=64, prefill_tokens=256))
    for gid in range(12):
        s.submit(Group(gid, prompt_len=150 + gid, max_tokens=2, chunkable=True))
    done: dict[int, int] = {}  # group -> prompt tokens computed
    first_pass = None
    for _ in range(200):
        waiting = list(s.slots[0].prefilling)  # chunked prompts, oldest first
        ps = s.next_pass(0)
        if ps is None:
            break
        first_pass = first_pass or ps
        assert list(ps.resume) == waiting[: len(ps.resume)]
        works = []
        for p in ps.prompts:
            start = ps.resume.get(p.row, 0)
            assert start == p.cached == done.get(p.gid, 0)  # resumed where its last chunk ended
            end = min(s.groups[p.gid].prompt_len, start + 64)
            assert p.end == end
            works.append(end - start)
            done[p.gid] = end
        assert len(works) * max(works, default=0) <= 256
        full = [r for gid, r in ps.prefill if done[gid] == s.groups[gid].prompt_len]
        s.on_reply(0, full, list(ps.decode_rows))  # a row decodes one token, then finishes
    assert s.idle() and sorted(done) == list(range(12)) and all(done[g] == 150 + g for g in done)
    assert first_pass.alloc == (12, 163) and len(first_pass.prefill) == 4  # 4 chunks of 64: 8 prompts wait


def test_passes_of_scoring_prompts_alone_take_the_smaller_cap():
    """A pass holding only scoring prompts (max_tokens 0: prefill only) computes at most
    ``scoring_tokens`` (a pipeline pays about one pass at each end of a scoring file, so its passes
    are small); a pass with a generating prompt, or beside rows decoding, keeps ``prefill_tokens``.
    Every prompt runs, each in exactly one pass."""
    s = Scheduler(SchedulerConfig(budget=100_000, num_slots=2, max_rows=16, prefill_tokens=1024, scoring_tokens=256))
    for gid in range(20):
        s.submit(Group(gid, prompt_len=60 + gid, max_tokens=0))
    seen = []
    for _ in range(100):
        for sid in (0, 1):
            ps = s.next_pass(sid)
            if ps is None:
                continue
            lens = [s.groups[gid].prompt_len for gid, _ in ps.prefill]
            assert len(lens) * max(lens) <= 256 or len(lens) == 1
            seen += [gid for gid, _ in ps.prefill]
            s.on_reply(sid, [], [r for _, r in ps.prefill])
        if s.idle():
            break
    assert sorted(seen) == list(range(20))
    mixed = Scheduler(SchedulerConfig(budget=100_000, num_slots=1, max_rows=16, prefill_tokens=1024, scoring_tokens=256))
    mixed.submit(Group(0, prompt_len=100, max_tokens=5))
    for gid in range(1, 8):
        mixed.submit(Group(gid, prompt_len=100, max_tokens=0))
    assert len(mixed.next_pass(0).prefill) == 8  # a generating prompt among them: 800 <= 1024
    beside = Scheduler(SchedulerConfig(budget=100_000, num_slots=1, max_rows=16, prefill_tokens=1024, scoring_tokens=256))
    beside.submit(Group(0, prompt_len=1000, max_tokens=5))
    for gid in range(1, 8):
        beside.submit(Group(gid, prompt_len=100, max_tokens=0))
    ps = beside.next_pass(0)
    assert [gid for gid, _ in ps.prefill] == [0]  # 2 x 1000 > 1024: the scoring prompts wait
    beside.on_reply(0, [r for _, r in ps.prefill], [])  # it decodes from now on
    assert len(beside.next_pass(0).prefill) == 7  # beside a decoding row: 700 <= the prefill cap


def test_a_slot_computing_prompts_only_runs_a_second_pass_ahead():
    """``next_pass(ahead=True)``: while a slot's pass in flight decodes no row, a second pass continues
    its chunked prompts without waiting for the answer (a pipeline's first stage keeps computing); not
    a third, not while a pass in flight decodes, not with tokens to feed. Replies come in order: a row
    whose last chunk was in the first pass decodes once both are answered, from its prompt's end."""
    s = Scheduler(SchedulerConfig(budget=10_000, num_slots=1, max_rows=4, chunk=32, prefill_tokens=64))
    s.submit(Group(0, prompt_len=100, max_tokens=3, chunkable=True))
    s.submit(Group(1, prompt_len=40, max_tokens=3, chunkable=True))
    first = s.next_pass(0)
    row0, row1 = first.rows_of[0][0], first.rows_of[1][0]
    second = s.next_pass(0, ahead=True)
    assert second.decode_rows == () and second.admitted == () and second.resume == {row0: 32, row1: 32}
    assert s.next_pass(0, ahead=True) is None  # two in flight at most
    s.on_reply(0, [], [])  # the first pass: nothing sampled
    third = s.next_pass(0, ahead=True)  # the second is still in flight and decodes nothing
    assert third.resume == {row0: 64} and third.decode_rows == ()
    s.on_reply(0, [row1], [])  # the second pass: group 1 sampled its first token
    assert s.next_pass(0, ahead=True) is None  # a token to feed: the next pass waits for the answers
    s.on_reply(0, [], [])
    ps = s.next_pass(0)
    assert ps.decode_rows == (row1,) and ps.column(row1) == 40 and ps.resume == {row0: 96}
    assert s.next_pass(0, ahead=True) is None  # the pass in flight decodes: its answer comes first
    s.on_reply(0, [row0, row1], [])
    ps = s.next_pass(0)
    assert ps.decode_rows == (row0, row1) and ps.column(row0) == 100 and ps.column(row1) == 41


def test_the_end_of_a_file_splits_decode_rows_over_passes_for_every_stage():
    """Nothing queued and fewer micro-batches holding rows than stages: a slot's decode rows split
    over passes in flight together (half each with one slot at P = 2), each row in one of them; the
    rows keep decoding from the right columns until they finish. Not while requests are queued, not
    with one stage, not in serve mode, not when the stages take turns with the node's cores."""
    s = Scheduler(SchedulerConfig(budget=10_000, num_slots=3, max_rows=8, stages=2))
    s.submit(Group(0, prompt_len=10, max_tokens=4, width=5))  # best_of 5: five rows in one micro-batch
    first = s.next_pass(0)
    assert not first.split and s.parts() == 2  # one slot holds everything
    rows = first.rows_of[0]
    s.on_reply(0, rows, [])  # every row sampled its first token
    a = s.next_pass(0)
    b = s.next_pass(0, ahead=True)
    assert a.split and b.split and s.next_pass(0, ahead=True) is None  # two in flight at most
    assert len(a.decode_rows) == 3 and len(b.decode_rows) == 2 and not set(a.decode_rows) & set(b.decode_rows)
    assert all(a.column(r) == 10 for r in a.decode_rows) and all(b.column(r) == 10 for r in b.decode_rows)
    s.on_reply(0, a.decode_rows, [])
    c = s.next_pass(0, ahead=True)  # a's rows again, while b is in flight
    assert c.decode_rows == a.decode_rows and all(c.column(r) == 11 for r in c.decode_rows)
    s.on_reply(0, [], b.decode_rows)  # b's rows finish
    d = s.next_pass(0, ahead=True)
    assert d is None  # c's rows are all in flight
    s.on_reply(0, c.decode_rows, [])
    e = s.next_pass(0)
    assert e.decode_rows == a.decode_rows[:2] and all(e.column(r) == 12 for r in e.decode_rows)  # 3 live / 2
    for other in (Scheduler(SchedulerConfig(budget=10_000, num_slots=3, max_rows=8, stages=1)),
                  Scheduler(SchedulerConfig(budget=10_000, num_slots=3, max_rows=8, stages=2), policy=ServePolicy()),
                  Scheduler(SchedulerConfig(budget=10_000, num_slots=1, max_rows=8, stages=2, turns=True))):
        other.submit(Group(0, prompt_len=10, max_tokens=4, width=2))
        ps = other.next_pass(0)
        other.on_reply(0, [r for rows in ps.rows_of.values() for r in rows], [])
        assert other.parts() == 1 and len(other.next_pass(0).decode_rows) == 2
    queued = Scheduler(SchedulerConfig(budget=10_000, num_slots=3, max_rows=1, stages=2))
    for gid in range(5):
        queued.submit(Group(gid, prompt_len=10, max_tokens=4))
    queued.next_pass(0)
    assert queued.parts() == 1  # requests wait: the other micro-batches will take them


def test_the_rest_of_a_file_spreads_evenly_over_free_micro_batches():
    """Once the queue holds the rest of the file (shorter than the look-ahead window), a new micro-batch
    takes an even share of its rows (40 prompts at P = 2: 14 + 13 + 13, not 32 + 8 with one idle), so
    the pipeline's micro-batches stay alike; with more input to come, or one micro-batch, they fill."""
    s = Scheduler(SchedulerConfig(budget=100_000, num_slots=3, max_rows=32))
    for gid in range(40):
        s.submit(Group(gid, prompt_len=400 + gid, max_tokens=64))
    assert [s.next_pass(sid).alloc[0] for sid in range(3)] == [14, 13, 13]
    full = Scheduler(SchedulerConfig(budget=100_000, num_slots=3, max_rows=32, window=16))
    one = Scheduler(SchedulerConfig(budget=100_000, num_slots=1, max_rows=32))
    for sched in (full, one):
        for gid in range(40):
            sched.submit(Group(gid, prompt_len=400 + gid, max_tokens=64))
        assert sched.next_pass(0).alloc[0] == (16 if sched is full else 32)  # (the window bounds its look-ahead)
