"""SERE calibration on the tiny checkpoint: the streamed Gram matrix and protection scores against
materialised expert outputs, a deterministic and well-formed file, and the loader's refusals."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from zipmoe.build.sere_calibrate import (
    IMAGE_PROMPTS, TEXT_PROMPTS, calibrate, gram_matrix, load_prompts_file, main, protection_scores, similarity,
    top_n,
)
from zipmoe.build.tiny_checkpoint import build_tiny_checkpoint
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.kernels.layer_ops import router_reference
from zipmoe.sere_file import SERE_FILE, SereTables, checkpoint_fingerprint, load_sere, save_sere

E, MOE_LAYERS = 16, [0, 1, 2, 3]  # the tiny checkpoint: 4 decoder layers, all MoE, 16 experts (top-4)


@pytest.fixture(scope="module")
def calibrated(tiny_checkpoint, tmp_path_factory):
    return calibrate(tiny_checkpoint, tmp_path_factory.mktemp("sere") / SERE_FILE)


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """Same config, tokenizer and tensor headers as the tiny checkpoint; other weights."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_seed1"), seed=1)


@pytest.fixture(scope="module")
def layer(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint, EngineConfig(num_kv_blocks=32, max_model_len=512)).model.layers[1]


def materialised(x, layer):
    """[E, T, H] float64: every expert on every token, one F.linear at a time as the engine computes it."""
    outs = []
    for p in range(E):
        gate, up = F.linear(x, layer.gate_up[p]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ layer.down[p])
    return torch.stack(outs).double()


def test_streamed_gram_matches_materialised_outputs(layer):
    x = torch.randn(37, layer.gate_up.shape[-1], generator=torch.Generator().manual_seed(0))
    a = materialised(x, layer).flatten(1)
    gram = gram_matrix(x, layer.gate_up, layer.down, token_chunk=5, expert_chunk=3)  # uneven chunks
    want = a @ a.T
    # float32 sums in another order: an entry near cancellation is off by ~eps of the largest terms.
    torch.testing.assert_close(gram, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())

    dist = (a[:, None] - a[None]).norm(dim=-1)
    torch.testing.assert_close(similarity(gram, "frobenius"), 1 - dist / dist.max(), rtol=0, atol=1e-5)
    unit = F.normalize(a, dim=-1)
    torch.testing.assert_close(similarity(gram, "cosine"), unit @ unit.T, rtol=0, atol=1e-5)


def test_protection_scores_match_a_loop_over_routed_slots(layer, tiny_checkpoint):
    x = torch.randn(23, layer.gate_up.shape[-1], generator=torch.Generator().manual_seed(1))
    a = materialised(x, layer)
    sim = similarity(gram_matrix(x, layer.gate_up, layer.down, 8, 4), "frobenius")
    got = protection_scores(x, layer.gate, layer.gate_up, layer.down, sim, 4, True, token_chunk=6, expert_chunk=5)

    partner = [max((q for q in range(E) if q != e), key=lambda q: sim[e, q]) for e in range(E)]
    _, ids, w = router_reference(x, layer.gate, 4, True)
    want = torch.zeros(E, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, weight in zip(ids[t].tolist(), w[t].tolist()):
            want[e] += weight * (a[partner[e], t] - a[e, t]).norm()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def test_top_n_breaks_ties_by_lower_index():
    assert top_n(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0]), 2).tolist() == [False, True, True, False, False]


def test_calibration_is_deterministic_and_well_formed(tiny_checkpoint, calibrated, tmp_path):
    assert calibrate(tiny_checkpoint, tmp_path / "again.safetensors").read_bytes() == calibrated.read_bytes()

    tables = load_sere(tiny_checkpoint, calibrated)
    sim = tables.similarity
    assert tables.method == "frobenius" and tables.moe_layers == MOE_LAYERS
    assert sim.shape == (4, E, E) and sim.dtype == torch.float32
    assert torch.equal(sim, sim.transpose(1, 2))
    assert (sim.diagonal(dim1=1, dim2=2) == 1).all()
    assert sim.min() >= 0 and sim.max() <= 1
    off = sim.masked_fill(torch.eye(E, dtype=torch.bool), 2.0)
    assert (off.flatten(1).min(dim=1).values == 0).all()  # the farthest pair of each layer
    assert tables.protect.dtype == torch.bool and tables.protect.sum(dim=1).tolist() == [E // 8] * 4

    with safe_open(calibrated, "pt") as f:
        meta = f.metadata()
    assert meta["fingerprint"] == checkpoint_fingerprint(tiny_checkpoint)
    assert meta["num_protect"] == "2" and meta["num_prompts"] == str(len(IMAGE_PROMPTS) + len(TEXT_PROMPTS))
    assert int(meta["num_tokens"]) == tables.num_tokens > 1000


def test_cli_cosine_with_user_prompts(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "Read the receipt: 2 x tea 3.20"}) + "\n\n"
                       + json.dumps({"text": "两杯咖啡多少钱？"}, ensure_ascii=False) + "\n", encoding="utf-8")
    out = tmp_path / "cosine.safetensors"
    assert main([str(tiny_checkpoint), "--method", "cosine", "--protect", "3", "--prompts", str(prompts),
                 "--device", "cpu", "--out", str(out)]) == 0

    tables = load_sere(tiny_checkpoint, out)
    sim = tables.similarity
    assert tables.method == "cosine"
    assert torch.equal(sim, sim.transpose(1, 2)) and (sim.diagonal(dim1=1, dim2=2) == 1).all()
    assert sim.min() >= -1 and sim.max() <= 1
    assert tables.protect.sum(dim=1).tolist() == [3] * 4
    with safe_open(out, "pt") as f:
        assert f.metadata()["num_prompts"] == str(len(IMAGE_PROMPTS) + len(TEXT_PROMPTS) + 2)


def test_max_tokens_keeps_the_leading_prompts(tiny_checkpoint, tmp_path):
    tables = load_sere(tiny_checkpoint, calibrate(tiny_checkpoint, tmp_path / "s.safetensors", max_tokens=300))
    assert 0 < tables.num_tokens <= 300


def test_prompts_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*\"text\""):
        load_prompts_file(bad)


def test_beside_the_checkpoint_it_loads_into_the_engine(tiny_checkpoint, calibrated, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt, ignore=shutil.ignore_patterns(SERE_FILE))
    with pytest.raises(FileNotFoundError, match=f"no {SERE_FILE} beside .*: run `zipmoe calibrate "):
        LLMEngine(ckpt, EngineConfig(num_kv_blocks=32, max_model_len=512, routing_policy="sere"))
    shutil.copy(calibrated, ckpt / SERE_FILE)  # the fingerprint skips the calibration file itself
    assert checkpoint_fingerprint(ckpt) == checkpoint_fingerprint(tiny_checkpoint)
    LLMEngine(ckpt, EngineConfig(num_kv_blocks=32, max_model_len=512, routing_policy="sere"))


def test_load_refuses_a_missing_foreign_or_misshapen_file(tiny_checkpoint, calibrated, other_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="zipmoe calibrate"):
        load_sere(tiny_checkpoint, tmp_path / "nothing.safetensors")
    with pytest.raises(ValueError, match="not a SERE calibration file"):
        load_sere(tiny_checkpoint, tiny_checkpoint / "model.safetensors")
    # Seed 1 differs from seed 0 only in the weights' values: the fingerprint must still tell them apart.
    with pytest.raises(ValueError, match="calibrated for another checkpoint"):
        load_sere(other_checkpoint, calibrated)

    good = load_sere(tiny_checkpoint, calibrated)
    fingerprint = checkpoint_fingerprint(tiny_checkpoint)
    small = SereTables(good.similarity[:, :8, :8], good.protect[:, :8], MOE_LAYERS, "frobenius", 10)
    with pytest.raises(ValueError, match="shape"):
        load_sere(tiny_checkpoint, save_sere(tmp_path / "small.safetensors", small, fingerprint))
    fewer = SereTables(good.similarity[:3], good.protect[:3], MOE_LAYERS[:3], "frobenius", 10)
    with pytest.raises(ValueError, match="MoE layers"):
        load_sere(tiny_checkpoint, save_sere(tmp_path / "fewer.safetensors", fewer, fingerprint))
