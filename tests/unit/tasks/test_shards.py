"""Data parallelism's shares of a file (tasks.shards): runs of lines dealt in turn, every line once."""


def test_shards_deal_runs_of_lines_and_cover_every_line_once():
    from tasks.shards import CHUNK, index_of, share_of, share_size

    for shares in (1, 2, 3):
        for total in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 7):
            seen = []
            for d in range(shares):
                n = share_size(d, total, shares)
                mine = [index_of(d, k, shares) for k in range(n)]
                assert all(share_of(i, shares) == d for i in mine) and mine == sorted(mine)
                assert index_of(d, n, shares) >= total  # where a resumed share would read on: past the end
                seen += mine
            assert sorted(seen) == list(range(total))
    assert [share_of(i, 2) for i in (0, CHUNK - 1, CHUNK, 2 * CHUNK)] == [0, 0, 1, 0]  # neighbours stay together
