"""Text in, text out: the checkpoint's tokenizer, chat template and generation defaults.

A byte-level BPE tokenizer trained here and a ChatML-style template sit beside a tiny qwen3
checkpoint made with transformers (``tests/text_checkpoint.py``). Text round-trips; the chat
prompt equals transformers' ``apply_chat_template`` for the same files (template in
``tokenizer_config.json`` and in ``chat_template.jinja``); streamed deltas concatenate to the
decoded text; every bad file or field is a one-line ``ConfigError`` naming file and field.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.errors import ConfigError
from metrale.runtime.engine import Engine
from metrale.runtime.sampling import Sampling
from metrale.runtime.text import ChatTemplate, GenerationDefaults, Text
from tests.text_checkpoint import make_text_checkpoint

pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world! "},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Über café 🙂"}],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text") / "ck")


@pytest.fixture(scope="module")
def ckpt_jinja(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text_jinja") / "ck", jinja_file=True)


@pytest.fixture(scope="module")
def text(ckpt):
    return Text.load(ckpt)


@given(st.text(max_size=60))
def test_text_round_trips(text, s):
    if "<|" in s:  # special-token spellings are added tokens, not text
        return
    assert text.decode(text.encode(s)) == s


def test_encoding_matches_transformers(ckpt, text):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    for s in ("The quick brown fox", "Über café 🙂 12345", "  spaces\tand\nlines  "):
        assert text.encode(s) == hf(s)["input_ids"]
        assert text.decode(text.encode(s)) == hf.decode(hf(s)["input_ids"])


@pytest.mark.parametrize("which", ["config", "jinja"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_prompt_equals_transformers(which, conv, gen, request):
    import transformers

    path = request.getfixturevalue("ckpt" if which == "config" else "ckpt_jinja")
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = Text.load(path)
    messages = CONVERSATIONS[conv]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.chat(messages, add_generation_prompt=gen) == want
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    if isinstance(want_ids, dict) or hasattr(want_ids, "keys"):
        want_ids = want_ids["input_ids"]
    assert ours.chat_ids(messages, add_generation_prompt=gen) == list(want_ids)


def test_template_refusal_is_a_config_error(text):
    with pytest.raises(ConfigError, match="chat_template: the template refused the messages: "
                                          "roles are user and assistant"):
        text.chat([{"role": "tool", "content": "x"}])


def test_template_features_match_transformers(tmp_path):
    """tojson, namespace, loop controls, trim/lstrip blocks and the special tokens, against
    transformers rendering the same template."""
    import transformers

    ck = make_text_checkpoint(tmp_path / "ck")
    tpl = ("{%- set ns = namespace(n=0) %}\n"
           "  {%- for m in messages %}\n"
           "    {%- if m.role == 'skip' %}{% continue %}{% endif %}\n"
           "    {%- set ns.n = ns.n + 1 %}\n"
           "{{ ns.n }}:{{ m | tojson }}{{ eos_token }}\n"
           "  {%- endfor %}\n"
           "{% if add_generation_prompt %}go{% endif %}")
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tpl
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "user", "content": "é \"q\" <b>"}, {"role": "skip", "content": "-"},
                {"role": "assistant", "content": "ok"}]
    hf = transformers.AutoTokenizer.from_pretrained(ck)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert Text.load(ck).chat(messages) == want
    assert '"é \\"q\\" <b>"' in want  # tojson: no ASCII or HTML escaping


def test_stream_deltas_concatenate_to_the_decoded_text(text):
    ids = text.encode("Hello, world! Über café 🙂 and 42 numbers.")
    for prime in ([], text.encode("Say:")):
        stream = text.stream(prime)
        deltas = [stream.push(i) for i in ids]
        assert "".join(deltas) == text.decode(ids)
        assert "" in deltas or len(ids) == len(deltas)  # multi-byte characters wait


def test_generation_defaults_and_stop_ids(text):
    assert text.defaults == GenerationDefaults(eos_ids=(0,), temperature=0.7, top_p=0.9,
                                               do_sample=True)
    assert set(text.stop_ids) == {0, text.tokenizer.token_to_id("<|im_end|>")}
    s = Sampling.from_defaults(text.defaults)
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 0)
    assert Sampling.from_defaults(GenerationDefaults(do_sample=False, temperature=0.7)).greedy


@pytest.mark.parametrize("file,content,match", [
    ("tokenizer_config.json", "{bad", r"tokenizer_config.json:1:2: not valid JSON"),
    ("tokenizer_config.json", '{"eos_token": 5}', r"tokenizer_config.json: eos_token: a special "
                                                  r"token is a string"),
    ("tokenizer_config.json", '{"eos_token": "<nope>"}', r"tokenizer_config.json: eos_token: the "
                                                         r"eos token is not in the tokenizer"),
    ("tokenizer_config.json", '{"chat_template": 3}', r"tokenizer_config.json: chat_template: a "
                                                      r"chat template is a string"),
    ("chat_template.jinja", "{% for %}", r"chat_template.jinja:1: chat_template: chat template "
                                         r"syntax error"),
    ("generation_config.json", '{"eos_token_id": "x"}', r"generation_config.json: eos_token_id: "
                                                        r"a token id or a list"),
    ("generation_config.json", '{"temperature": -1}', r"generation_config.json: temperature: bad "
                                                      r"generation default"),
    ("generation_config.json", "[1]", r"generation_config.json: must hold a JSON object"),
    ("tokenizer.json", "{}", r"tokenizer.json: tokenizers cannot read it"),
])
def test_bad_files_name_the_file_and_field(tmp_path, ckpt, file, content, match):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    (d / file).write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        Text.load(d)
    assert "\n" not in str(info.value)


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json: the checkpoint has no tokenizer"):
        Text.load(tmp_path)


def test_template_is_sandboxed():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ConfigError, match="chat_template"):
        t.render([{"role": "user", "content": "x"}])


def test_engine_generates_text_and_streams_it(ckpt):
    with Engine.load(ckpt, act="f32", max_ctx=64) as eng:
        g = eng.generate("The quick brown", 8, sampling=Sampling())
        assert g.text == eng.text.decode(g.ids)
        assert g.prompt_tokens == len(eng.text.encode("The quick brown"))
        deltas = list(eng.stream("The quick brown", 8, sampling=Sampling()))
        assert [t for d in deltas for t in d.ids] == list(g.ids)
        assert "".join(d.text for d in deltas) == g.text
        assert deltas[-1].finish == g.finish
        chat = eng.generate("What is two plus two?", 4, chat=True, sampling=Sampling())
        assert chat.prompt_tokens == len(eng.text.chat_ids(
            [{"role": "user", "content": "What is two plus two?"}]))
        seeded = Sampling(temperature=1.0, top_p=0.95, seed=42)
        a = eng.generate("Hello", 12, sampling=seeded)
        b = eng.generate("Hello", 12, sampling=seeded)
        assert a.ids == b.ids and len(a.ids) >= 1


def test_stop_strings_cut_the_text(ckpt):
    with Engine.load(ckpt, act="f32", max_ctx=64) as eng:
        full = eng.generate("Hello", 12, sampling=Sampling())
        if len(full.text) < 3:
            pytest.skip(f"the greedy text is too short to cut: {full.text!r}")
        stop = full.text[1:3]
        cut = eng.generate("Hello", 12, sampling=Sampling(), stop=[stop])
        assert cut.finish == "stop"
        assert cut.text == full.text[:full.text.index(stop)]
        streamed = "".join(d.text for d in eng.stream("Hello", 12, sampling=Sampling(),
                                                      stop=[stop]))
        assert streamed == cut.text


def test_met_run_streams_the_text_generate_gives(ckpt, capsys):
    from metrale.cli import main

    with Engine.load(ckpt, act="f32", max_ctx=64) as eng:
        want = eng.generate("The quick brown", 6, sampling=Sampling()).text
        chat = eng.generate("Hi", 5, sampling=Sampling(), chat=True).text
        # the flags override generation_config.json's defaults (top_p 0.9 stays)
        seeded = eng.generate("Hello", 6, sampling=Sampling(temperature=1.0, top_k=50,
                                                             top_p=0.9, seed=11)).text
    base = ["run", str(ckpt), "--act", "f32", "--context", "64", "--no-progress"]
    assert main([*base, "--prompt", "The quick brown", "--max-tokens", "6",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == want + "\n" and "tokens, finish" in out.err
    assert main([*base, "--prompt", "Hi", "--chat", "--max-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == chat + "\n"
    assert main([*base, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "1",
                 "--top-k", "50", "--seed", "11"]) == 0
    assert capsys.readouterr().out == seeded + "\n"
    assert main([*base, "--prompt-ids", "5,6,7", "--steps", "3"]) == 0
    assert "tokens: [" in capsys.readouterr().out
    assert main([*base, "--prompt", "x", "--top-p", "0"]) == 3
    assert "met: top_p: bad sampling parameter" in capsys.readouterr().err
