"""realize/entries.py: the entries of a CUDA source, and a source cut to one kernel's entries
(what the build compiles for that kernel)."""

from __future__ import annotations

import re

import pytest

from metrale.realize.entries import entry_spans, keep_entries
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir

SOURCES = sorted([*default_kernels_dir().glob("cuda/common/*.cu"),
                  *default_kernels_dir().glob("sm_*/common/*.cu")])


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_entry_of_every_source_is_found(source):
    text = source.read_text()
    spans = entry_spans(text)
    assert len(spans) == len(re.findall(r'extern "C" __global__', text)) > 0
    for name, (start, end) in spans.items():
        body = text[start:end]
        assert body.startswith("extern") and body.endswith("}") and name in body


def test_each_kernel_of_sm_90_keeps_exactly_its_entries():
    """For every kernel sm_90 realizes, its unit's text defines its entries and no other, on
    the same lines as the source (a compiler's line numbers still point into the file)."""
    from metrale.realize.build import unit_source

    seen = 0
    for k in realization("sm_90").kernels():
        if k.source is None:
            continue
        text = (default_kernels_dir() / k.source).read_text()
        cut, headers = unit_source(default_kernels_dir(), k)
        # the source's own entries, and those of a source it includes (gemm_tma.cu's `then`
        # launches are gemm_wgmma.cu's entries), each cut to the kernel's
        included = {n: h for n, h in headers.items() if n.endswith(".cu")}
        defined = [e for h in (cut, *included.values()) for e in entry_spans(h)]
        assert sorted(defined) == sorted(k.entries), k.key
        assert cut.count("\n") == text.count("\n")
        for name, (start, end) in entry_spans(cut).items():
            assert cut[start:end] == text[slice(*entry_spans(text)[name])]  # kept verbatim
        seen += 1
    assert seen > 50


ADVERSARIAL = '''// extern "C" __global__ void in_a_comment() {}
/* extern "C" __global__ void in_a_block() { */
extern "C" __global__ void declared_only(int);
#define BRACE '}'
extern "C" __global__ void __launch_bounds__(128, (2))
first(const char* s = nullptr) {
    const char* t = "} { \\" }";  // } in a comment
    char c = '}', d = '{';
    /* } */ if (s) { return; }
}
template <int N> __device__ void helper() { }
extern "C" __global__ void second(int a) { helper<(1 > 0)>(); }
'''


def test_comments_strings_and_declarations_do_not_confuse_it():
    assert set(entry_spans(ADVERSARIAL)) == {"first", "second"}
    cut = keep_entries(ADVERSARIAL, ["second"])
    assert set(entry_spans(cut)) == {"second"} and "const char* t" not in cut
    assert "helper" in cut and "declared_only(int);" in cut and cut.count("\n") == \
        ADVERSARIAL.count("\n")
    assert keep_entries(ADVERSARIAL, ["first", "second"]) == ADVERSARIAL


def test_what_cannot_be_cut_is_compiled_whole():
    """An entry the source lacks, or braces that do not balance: the text as it is, so that the
    build reports the fault as for the whole source ("entry not exported", nvcc's error)."""
    assert keep_entries(ADVERSARIAL, ["third"]) == ADVERSARIAL
    broken = ADVERSARIAL + "\nextern \"C\" __global__ void open() {\n"
    assert keep_entries(broken, ["second"]) == broken
