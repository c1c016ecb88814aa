"""Architecture registry: built-in `transformer-lm` and plugins found through real entry points."""

import sys
import textwrap

import pytest
import torch

from swarmd.job import JobSpec, SpecError
from swarmd.model import ConfigError, UnknownArchitecture, available, build_stage, get_architecture
from swarmd.model.config import parse_table
from swarmd.model.transformer import TransformerConfig

torch.set_num_threads(1)


def test_builtin_transformer():
    arch = get_architecture("transformer-lm")
    config = arch.parse_config({"d_model": 16, "n_heads": 2}, 8)
    assert config == TransformerConfig(d_model=16, n_heads=2, max_seq_len=8)
    assert "transformer-lm" in available()


def test_unknown_architecture():
    with pytest.raises(UnknownArchitecture, match="transformer-lm"):
        get_architecture("nope")


def test_parse_table_names_keys():
    with pytest.raises(ConfigError) as info:
        parse_table(TransformerConfig, {"d_model": 16, "n_heads": 3, "max_seq_len": 8}, "model")
    assert info.value.field == "model.n_heads"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A real installed distribution on sys.path whose entry point adds the `tiny-mlp` architecture."""
    (tmp_path / "tiny_mlp_arch.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        from torch import nn
        from swarmd.model import Architecture, Stage, TensorSpec, init_generator
        from swarmd.model.config import parse_table

        @dataclass(frozen=True)
        class MlpConfig:
            width: int
            vocab: int = 256

        class MlpStage(Stage):
            def __init__(self, config, index, n):
                super().__init__(index, n)
                self.lin = nn.Linear(config.width, config.width)
            def input_spec(self, b, t):
                return TensorSpec((b, t, self.lin.in_features), torch.float32)
            def output_spec(self, b, t):
                return self.input_spec(b, t)
            def forward(self, x, targets=None):
                return self.lin(x)

        def build(config, index, n, seed, device="cpu"):
            stage = MlpStage(config, index, n)
            with torch.no_grad():
                stage.lin.weight.normal_(generator=init_generator(seed, index))
            return stage.to(device)

        ARCH = Architecture("tiny-mlp", MlpConfig, lambda raw, seq_len: parse_table(MlpConfig, raw), build)
    '''))
    dist = tmp_path / "tiny_mlp_arch-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-mlp-arch\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[swarmd.architectures]\ntiny-mlp = tiny_mlp_arch:ARCH\nbroken = no_such_module_xyz:ARCH\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("tiny_mlp_arch", None)


def test_entry_point_architecture(plugin):
    assert "tiny-mlp" in available()
    spec = JobSpec.from_dict({
        "name": "p", "steps": 1, "model": {"arch": "tiny-mlp", "width": 4},
        "data": {"files": ["x"], "seq_len": 2}, "batch": {"global_samples": 1, "microbatch_samples": 1},
    })
    assert spec.model.arch == "tiny-mlp" and spec.to_dict()["model"] == {"arch": "tiny-mlp", "vocab": 256, "width": 4}
    a, b = build_stage(spec.model.config, 0, 2, seed=1), build_stage(spec.model.config, 0, 2, seed=1)
    assert torch.equal(a.lin.weight, b.lin.weight)
    with pytest.raises(SpecError, match=r"^model\.arch: .*failed to load"):
        JobSpec.from_dict({**spec.to_dict(), "model": {"arch": "broken"}})
    with pytest.raises(SpecError, match=r"^model\.width: must be an integer"):
        JobSpec.from_dict({**spec.to_dict(), "model": {"arch": "tiny-mlp", "width": "4"}})
