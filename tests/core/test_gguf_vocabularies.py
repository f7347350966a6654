"""The tokenizers ContextPaw rebuilds from a GGUF file give the model's own token ids.

Ollama names the model's GGUF file, and a tokenizer rebuilt from it counts exactly where the byte
estimate would price every text at the densest text's rate. llama.cpp's source ships vocabulary-only
GGUF files with test inputs and the ids its reference tokenizer makes of them
(`scripts/install/get_vocabularies.py` takes them out of the pinned source once); each pre-tokenizer group
ContextPaw knows is checked against one of them, input for input.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from contextpaw.core.tokens import (
    PRE_TOKENIZERS,
    TokenizerCounter,
    Vocabulary,
    read_vocabulary,
    tokenizer_from_gguf,
    tokenizer_of,
)

REPO = Path(__file__).resolve().parents[2]
VOCABULARIES = {
    "gpt-2": "gpt-2",
    "mpt": "mpt",
    "starcoder": "starcoder",
    "refact": "refact",
    "llama-bpe": "llama-bpe",
    "qwen2": "qwen2",
    "qwen35": "qwen35",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
}
"""Each byte-level vocabulary file checked, and the `tokenizer.ggml.pre` it names (asserted from the file)."""
SENTENCEPIECE = ("llama-spm", "phi-3")
"""SentencePiece vocabularies checked (Llama 2's, and Phi-3's with its control and user-defined tokens)."""
SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocabularies() -> Path:
    got = subprocess.run([sys.executable, str(REPO / "scripts" / "install" / "get_vocabularies.py")], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.fail(f"scripts/install/get_vocabularies.py exited {got.returncode}: {got.stderr.strip()[-800:]}")
    return Path(got.stdout.strip())


@pytest.mark.parametrize("vocabulary", [*VOCABULARIES, *SENTENCEPIECE])
def test_a_tokenizer_rebuilt_from_gguf_gives_llama_cpps_own_token_ids(vocabularies: Path, vocabulary: str) -> None:
    read = read_vocabulary(str(vocabularies / f"ggml-vocab-{vocabulary}.gguf"))
    assert (read.model, read.pre) == (("llama", "default") if vocabulary in SENTENCEPIECE else ("gpt2", VOCABULARIES[vocabulary]))
    tokenizer = tokenizer_of(read)
    inputs = (vocabularies / f"ggml-vocab-{vocabulary}.gguf.inp").read_text(encoding="utf-8").removesuffix(SEPARATOR).split(SEPARATOR)
    expected = (vocabularies / f"ggml-vocab-{vocabulary}.gguf.out").read_text(encoding="utf-8").removesuffix("\n").split("\n")
    assert len(inputs) == len(expected) > 40 and inputs[-1] and expected[-1]
    wrong = [(text, ids) for text, ids in zip(inputs, expected, strict=True)
             if tokenizer.encode(text, add_special_tokens=False).ids != [int(i) for i in ids.split()]]  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(inputs)} inputs tokenized otherwise than llama.cpp, first {wrong[0][0]!r}"
    assert TokenizerCounter(tokenizer).text(inputs[-1]) == len(expected[-1].split())


def test_control_tokens_in_a_rendered_chat_count_as_one_token_each(vocabularies: Path) -> None:
    read = read_vocabulary(str(vocabularies / "ggml-vocab-qwen2.gguf"))
    ids = tokenizer_of(read).encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == read.tokens.index("<|im_start|>") and ids[-1] == read.tokens.index("<|im_end|>") and len(ids) == 5


def test_every_pre_tokenizer_group_is_checked_against_llama_cpps_ids() -> None:
    checked = {id(PRE_TOKENIZERS[pre]) for pre in VOCABULARIES.values()}
    assert checked == {id(group) for group in PRE_TOKENIZERS.values()}


@pytest.mark.parametrize(("model", "pre"), [("gpt2", "default"), ("gpt2", "tekken"), ("gpt2", "gpt-4o"), ("gpt2", "poro-chat"),
                                          ("bert", "default"), ("gemma4", "default")])  # fmt: skip
def test_a_vocabulary_whose_splitting_is_not_known_here_is_refused_not_guessed(tmp_path: Path, model: str, pre: str) -> None:
    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"{model}/{pre}"):
        tokenizer_from_gguf(str(path))


@pytest.mark.parametrize(("prefix", "pieces"), [(True, ["\u2581hi", "\u2581there"]), (False, ["hi", "\u2581there"])])
def test_a_sentencepiece_vocabulary_leads_with_a_space_only_where_it_says_so(prefix: bool, pieces: list[str]) -> None:
    tokens = ["<unk>", "\u2581", "h", "i", "t", "e", "r", "hi", "\u2581hi", "th", "the", "ther", "there", "\u2581there"]
    scores = [0.0, -1, -1, -1, -1, -1, -1, -2, -3, -4, -5, -6, -7, -8]
    vocabulary = Vocabulary("llama", "default", tokens, [], [2] + [1] * (len(tokens) - 1), scores, 0, add_space_prefix=prefix)
    assert tokenizer_of(vocabulary).encode("hi there", add_special_tokens=False).tokens == pieces
