"""The embedded default model: shipped files, offline tokenizer, and answers that are right.

The accuracy tests draw fresh questions with a seed the training never used, run the real runner
(P = 1 with python, P = 2 with torchrun over gloo on loopback) and score its output file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from examples import check_default_model as check
from pipeline.loading import default_model as dm
from tests.utils import REPO, read_jsonl, run_local

HELDOUT_SEED = 2024  # training draws rows with seed 1, tokenizer text with 0; the checker uses 12345
N_PER_TASK = 60
HELDOUT_P2_EVERY = 3  # the P = 2 run takes every third held-out question (its answers must equal P = 1's)
# 90% for every task (issue 17 asks it of the path and multiple-choice tasks) but the thinking chats
# (issue 59: path questions and sums asked to think, the answer after the thinking); what the shipped
# model (v5) measures through the runner at P = 1 and 2 (seed 2024, 60 questions per task): path 98% / 93%,
# sums 100%, reverse 98%, the rest 100%; thinking path questions 93%, thinking sums 63% (its trace copies the
# question's numbers, which it gets wrong the most)
FLOORS = {"path/0-shot": 0.9, "path/few-shot": 0.9, "owner/choice": 0.9, "owner": 0.9,
          "arith/0-shot": 0.9, "arith/few-shot": 0.9, "copy": 0.9, "reverse": 0.9,
          "path/think": 0.85, "arith/think": 0.55}
TEXTS = [
    "Hello, world! The café on Elm Street is naïve about 日本 and 東京 🙂.",
    "  leading spaces, trailing spaces  \n\ttabs and\r\nnewlines\n",
    "Numbers 0 12 345 6789, prices $3.50 and 100%; symbols <>&#@{}[]|\\~`^",
    "Unseen scripts: Ωμέγα, русский, हिन्दी, عربى, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, ZWJ 👩‍👩‍👧",
    "",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return dm.default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_shipped_folder_is_complete_and_small(model_dir: str) -> None:
    folder = Path(model_dir)
    assert folder == REPO / "examples" / "tiny-llama-default"
    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"}
    assert names <= {p.name for p in folder.iterdir()}
    weights = (folder / "model.safetensors").read_bytes()
    assert 1_000_000 < len(weights) < 10_000_000
    # A real safetensors file (8-byte header length, then JSON), not a Git LFS pointer.
    assert weights[8:9] == b"{" and not weights.startswith(b"version https://git-lfs")


def test_config_is_a_small_llama(model_dir: str, tokenizer) -> None:
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == len(tokenizer) == 1024
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000


def test_build_tokenizer_is_the_shipped_one(tokenizer) -> None:
    built = dm.build_tokenizer()
    assert built.get_vocab() == tokenizer.get_vocab() and len(built) == 1024
    assert built("Q: 3 + 4 =")["input_ids"] == tokenizer("Q: 3 + 4 =")["input_ids"]


def test_special_tokens_and_bos(tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    ids = tokenizer("The harbor is quiet.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer("x", add_special_tokens=False)["input_ids"][0] != tokenizer.bos_token_id
    assert tokenizer.padding_side == "left"


def test_task_words_are_single_tokens(tokenizer) -> None:
    """Two directions are two tokens: the shared few-shot file asks for max_tokens 2."""
    for word in ["north", "south", "east", "west", "kitchen", "hallway", "garden"]:
        assert len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1, word


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_exactly(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, café?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>system: Be brief.\nuser: Hi, café?\nassistant:"
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_hf_greedy_on_the_readme_question(model_dir: str, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    prompt = ("Passage: The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
              "Question: How do you go from the hallway to the garden?\nAnswer:")
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]) == " north west"


def test_training_rows_point_the_circuit_at_the_right_tokens(tokenizer) -> None:
    """The training script's rows: the task's own text, tokenized whole, and every attention target
    on the token the circuit reads (a wrong offset would train the heads to look elsewhere)."""
    from examples import train_default_model as tdm

    rows, chats = tdm.Rows(tokenizer, seed=3), tdm.Rows(tokenizer, seed=4, mix=tdm.MIX_THINK)  # v5's fine-tune too
    seen = set()
    for k in range(120):
        ids, weights, links = (rows if k % 2 else chats).row(tdm.ROW_TOKENS)
        text = tokenizer.decode(ids[1:-1])
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:-1]
        assert len(weights) == len(ids) - 1
        word = [tokenizer.decode([i]).strip() for i in ids]
        for role, q, targets in links:
            seen.add(role)
            assert targets and all(k < q for k in targets), (role, q, targets)
            if role in ("fact_x", "fact_d"):  # from y to x / d of "The x is d of the y."
                assert word[q - 1] == "the" and word[targets[0]] == word[q - (5 if role == "fact_x" else 3)]
            if role in ("first", "second"):  # the target fact is on the path and states the answer
                assert word[targets[0] - 3] == word[q + 1] and word[targets[0] - 2] == "of"
            if role == "colour":  # the asked person's colour is what the answer says next
                assert word[targets[0]] == word[q + 1] and word[q] == "a"
            if role in ("object", "copy_next"):  # the target is the word the answer says next
                assert word[targets[0]] == word[q + 1]
            if role == "prev_word":
                assert targets == [q - 1]
            if role == "reverse_from":  # the current word's place; the word before it comes next
                assert word[targets[0]] == word[q] and word[targets[0] - 1] == word[q + 1]
            if role in ("operand_x", "operand_y"):  # at "=", or at "assistant:" of a chat answered at once
                assert word[targets[0]].isdigit() and (word[q] == ":" or targets == [q - (3 if role == "operand_x" else 1)])
        assert set(weights) <= {1.0, tdm.CTX_WEIGHT, tdm.STORY_WEIGHT}  # answers weigh 1, prompts less
    assert seen == set(tdm.CIRCUIT), set(tdm.CIRCUIT) - seen


@pytest.fixture(scope="module")
def heldout_runs(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> dict[int, list[dict]]:
    """Output lines of the runner on fresh held-out questions, at P = 1, and at P = 2 on every third
    question (``HELDOUT_P2_EVERY``: the same tasks, a third of the time; in this process: ``--in-process``)."""
    tmp = tmp_path_factory.mktemp("heldout")
    requests = check.heldout_requests(HELDOUT_SEED, N_PER_TASK, tokenizer)
    runs = {}
    for p in (1, 2):
        src, out = tmp / f"heldout_p{p}.jsonl", tmp / f"out_p{p}.jsonl"
        check.write_jsonl(src, requests if p == 1 else requests[::HELDOUT_P2_EVERY])
        # --batch-invariant: P = 1 and P = 2 must then give the same answers on every machine
        # --num-threads 1: two threads per rank oversubscribe a loaded CI machine (measured: > 300 s)
        args = ["--infer-data", str(src), "--output-path", str(out), "--no-progress", "--batch-invariant",
                "--num-threads", "1"]
        proc = run_local(args, p)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[p] = read_jsonl(out)
    return runs


