"""Loading weights: sharded checkpoints through their index, dummy weights of a config's shapes
(the real 30B-A3B shape included, without materialising it), and the KV-cache memory arithmetic."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zipmoe import serve
from zipmoe.checkpoint import INDEX, TEXT_PREFIX, TensorStore, TextConfig
from zipmoe.dummy_weights import DummyWeights
from zipmoe.engine import memory
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.sequence import SamplingParams
from zipmoe.vision import VisionEncoder

REAL_SHAPE = serve.REAL_SHAPE_CHECKPOINT
GIB = 1 << 30


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint re-saved as Hugging Face shards it: three files and an index."""
    out = tmp_path_factory.mktemp("sharded")
    for f in tiny_checkpoint.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    with safe_open(tiny_checkpoint / "model.safetensors", "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({k: tensors[k] for k in part}, out / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def greedy_tokens(checkpoint, **config) -> list[int]:
    eng = LLMEngine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=32, max_model_len=128, **config))
    seq = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=12, ignore_eos=True))
    while eng.has_work:
        eng.step()
    return seq.output_ids


def test_sharded_checkpoint_reads_through_its_index(tiny_checkpoint, sharded, capsys):
    whole, shards = TensorStore(tiny_checkpoint), TensorStore(sharded)
    names = whole.names(("",))
    assert sorted(shards.names(("",))) == sorted(names)
    assert all(torch.equal(whole.get(n), shards.get(n)) for n in names)
    assert greedy_tokens(sharded) == greedy_tokens(tiny_checkpoint)
    out = capsys.readouterr().out
    assert "decoder weights:" in out and "from 3 file(s) to cpu" in out and "GB/s" in out


def test_an_index_naming_a_missing_shard_is_refused(sharded, tmp_path):
    for f in sharded.iterdir():
        if f.name != "model-00002-of-00003.safetensors":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        TensorStore(tmp_path)


def test_dummy_weights_have_the_real_shapes_and_are_deterministic():
    dummy = DummyWeights(REAL_SHAPE, torch.device("cpu"))
    text = TextConfig.from_dir(REAL_SHAPE)
    assert dummy.shapes[TEXT_PREFIX + "layers.47.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)
    assert dummy.shapes["lm_head.weight"] == (text.vocab_size, 2048)
    decoder_gb = dummy.nbytes((TEXT_PREFIX, "lm_head.")) / 1e9
    assert 60 < decoder_gb < 62  # Qwen3-VL-30B-A3B's text decoder in bf16
    assert 0.8 < dummy.nbytes(("model.visual.",)) / 1e9 < 1.4
    gate = TEXT_PREFIX + "layers.3.mlp.gate.weight"
    again = DummyWeights(REAL_SHAPE, torch.device("cpu"))
    assert torch.equal(dummy.get(gate), again.get(gate))  # same seed, same tensor, whatever the order
    assert not torch.equal(dummy.get(gate), dummy.get(TEXT_PREFIX + "layers.4.mlp.gate.weight"))
    assert torch.equal(dummy.get(TEXT_PREFIX + "norm.weight"), torch.ones(2048, dtype=torch.bfloat16))


def test_dummy_weights_serve_like_a_checkpoint(tiny_checkpoint):
    tokens = greedy_tokens(tiny_checkpoint, load_format="dummy")
    assert tokens == greedy_tokens(tiny_checkpoint, load_format="dummy") != greedy_tokens(tiny_checkpoint)
    encoder = VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32, load_format="dummy")
    features = encoder.features([torch.randn(3, 64, 64)])
    assert torch.isfinite(features[0].embeds).all() and features[0].embeds.shape == (4, 64)


def test_kv_cache_gets_our_share_less_weights_activations_and_reserve():
    per_block = memory.block_bytes(TextConfig.from_dir(REAL_SHAPE), 16, torch.bfloat16)
    assert per_block == 2 * 48 * 16 * 4 * 128 * 2  # 96 KiB per 16 tokens at the 30B shape
    plan = memory.MemoryPlan(total=140 * GIB, weights=62 * GIB, activations=6 * GIB, free=70 * GIB, utilization=0.9)
    assert plan.kv_bytes() == int(0.9 * 140 * GIB - 68 * GIB) - memory.RESERVE_BYTES  # our share binds
    crowded = memory.MemoryPlan(total=140 * GIB, weights=62 * GIB, activations=6 * GIB, free=30 * GIB,
                                utilization=0.9)
    assert crowded.kv_bytes() == 24 * GIB - memory.RESERVE_BYTES  # what is free binds (another process)
    assert crowded.num_blocks(per_block) == crowded.kv_bytes() // per_block
    tight = memory.MemoryPlan(total=80 * GIB, weights=62 * GIB, activations=6 * GIB, free=12 * GIB, utilization=0.5)
    assert tight.num_blocks(per_block) == 0 and "KV cache 0.0 GiB" in tight.describe()
    graphs = memory.MemoryPlan(total=140 * GIB, weights=62 * GIB, activations=6 * GIB, free=70 * GIB,
                               utilization=0.9, graphs=GIB)
    assert graphs.kv_bytes() == plan.kv_bytes() - GIB and "graphs 1.00 GiB" in graphs.describe()


def test_cpu_engine_sizes_its_cache_without_a_parameter(tiny_checkpoint):
    eng = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", max_model_len=256))
    assert eng.blocks.num_blocks == memory.CPU_KV_BLOCKS and eng.kv_capacity_tokens == memory.CPU_KV_BLOCKS * 16


def test_calibration_reads_the_dummy_weights_the_server_makes(tiny_checkpoint, tmp_path):
    from zipmoe.build.sere_calibrate import calibrate
    from zipmoe.sere_file import load_sere

    dummy = calibrate(tiny_checkpoint, tmp_path / "sere_dummy.safetensors", device="cpu", max_tokens=512,
                      load_format="dummy")
    real = calibrate(tiny_checkpoint, tmp_path / "sere_real.safetensors", device="cpu", max_tokens=512)
    a, b = load_sere(tiny_checkpoint, dummy), load_sere(tiny_checkpoint, real)
    assert a.similarity.shape == b.similarity.shape and not torch.equal(a.similarity, b.similarity)
    again = calibrate(tiny_checkpoint, tmp_path / "again.safetensors", device="cpu", max_tokens=512,
                      load_format="dummy")
    assert torch.equal(load_sere(tiny_checkpoint, again).similarity, a.similarity)  # same seed, same weights


def test_dummy_experts_come_in_groups_that_calibrate_as_alike(tiny_checkpoint, tmp_path):
    from zipmoe.build.sere_calibrate import calibrate
    from zipmoe.dummy_weights import EXPERT_GROUP
    from zipmoe.sere_file import load_sere

    sim = load_sere(tiny_checkpoint, calibrate(tiny_checkpoint, tmp_path / "s.safetensors", device="cpu",
                                               max_tokens=512, load_format="dummy")).similarity
    group = torch.arange(sim.shape[-1]) // EXPERT_GROUP
    same = (group[:, None] == group[None, :]) & ~torch.eye(sim.shape[-1], dtype=torch.bool)
    across = group[:, None] != group[None, :]
    within, between = sim[:, same].mean().item(), sim[:, across].mean().item()
    assert within > 0.5 > between  # SERE at rho 0.5 moves a slot inside its group, never across


@pytest.mark.parametrize("tokens, context", [(40, 16), (15, 16), (8, 64), (40, 41)])  # the last: prefill graphs' bound
def test_the_worst_case_step_runs_chunks_that_end_long_contexts(tiny_checkpoint, tokens, context):
    """What memory planning measures on a GPU, run on the CPU: every token in a chunk that starts
    after its sequence's first token (the lower-right causal path), finite logits for the rows asked."""
    eng = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", num_kv_blocks=32, max_model_len=128))
    ids, step, kv, rows = memory.worst_case_inputs(eng.model, eng.text, tokens, context, 4, 16, 2)
    assert sum(c.rows.stop - c.rows.start for c in step.chunks) == tokens == ids.shape[0]
    assert all(c.start >= 1 and c.context_slots.numel() == context for c in step.chunks)
    logits = eng.model.forward(ids, step, kv, rows).logits
    assert logits.shape == (min(4, tokens), eng.text.vocab_size) and torch.isfinite(logits).all()
