"""Circuit weight inputs match what a transformers checkpoint of the tiny configs holds.

Names and shapes are compared, modulo the two documented differences: the loader stacks the
per-expert tensors ``mlp.experts.{e}.X`` into ``mlp.experts.X`` ``[experts, ...]``, and a tied
``lm_head`` reads ``model.embed_tokens.weight``.
"""

import re
from pathlib import Path

import pytest
from safetensors import safe_open

from metrale.plan.circuit import circuit_for
from metrale.plan.config import ModelConfig
from tests.oracle import make_hf_checkpoint

pytest.importorskip("transformers")

CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3_moe-mixed": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+\.weight)$")


def _checkpoint_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape, with per-expert tensors stacked as the loader stacks them."""
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[int, ...]]] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                m = _EXPERT.match(name)
                if m:
                    experts.setdefault(f"{m.group(1)}.{m.group(3)}", []).append(shape)
                else:
                    shapes[name] = shape
    for name, parts in experts.items():
        assert len(set(parts)) == 1, name
        shapes[name] = (len(parts), *parts[0])
    return shapes


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[Path, str]:
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(arch, path, **overrides), request.param


def test_weight_names_and_shapes_match(checkpoint) -> None:
    ckpt, case = checkpoint
    config = ModelConfig.load(ckpt)
    c = circuit_for(config, rows=2)
    sizes = c.sizes(max_ctx=16)
    ours = {n: c.input_type(n).bind(sizes).shape for n in c.weight_names}
    theirs = _checkpoint_shapes(ckpt)
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)  # transformers may or may not write the tied copy
    assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
    assert ours == theirs
    if case == "qwen3_moe-mixed":
        assert "model.layers.1.mlp.down_proj.weight" in ours
        assert "model.layers.2.mlp.experts.down_proj.weight" in ours
