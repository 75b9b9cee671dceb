"""ninfer_core/bench_step.py: a decode step's table by kernel kind (scripts/profile_decode.py
--timeline). Bytes are checked against the tiny model's own tensors, picked by their checkpoint
names, and the step's shares against hand-made timelines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_core.bench import BenchSetup, _build, _Harness
from ninfer_core.bench_step import (
    DENSE_GEMM, GEMV_KERNEL, KERNEL_ROWS, OTHER, KindRow, compare, kernel_base_name, kind_bytes, markdown,
    projection_bytes, step_table,
)

GEMV = f"void ninfer::(anonymous namespace)::{GEMV_KERNEL}<__nv_bfloat16, (ninfer::Codes)0, 1>(x)"


def _kernel(base: str) -> str:
    return f"void ninfer::(anonymous namespace)::{base}<__nv_bfloat16, 8, true>(__nv_bfloat16*, float const*)"


@pytest.fixture(scope="module")
def tiny():
    setup = BenchSetup(model="tiny-qwen3.6-moe", device="cpu", weights="int4", prefill_lengths=(),
                       decode_contexts=(64,), decode_batches=(1,), decode_steps=2, batch_context=64)
    model, config, dev, dtype, _ = _build(setup)
    return model, config, _Harness(model, config, dev, dtype, setup)


def _bytes_named(model: torch.nn.Module, *parts: str) -> int:
    """Bytes of the state dict's tensors whose names contain every one of `parts`."""
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if all(p in name for p in parts))


def test_kernel_base_name_drops_namespaces_templates_and_arguments():
    assert kernel_base_name(GEMV) == GEMV_KERNEL
    assert kernel_base_name(_kernel("gdn_recurrent_kernel")) == "gdn_recurrent_kernel"
    assert kernel_base_name("void at::native::unrolled_elementwise_kernel<at::native::direct_copy>(int)") == \
        "unrolled_elementwise_kernel"


def test_projections_come_in_the_forward_order_with_their_weights_bytes(tiny):
    model, config, _ = tiny
    rows = projection_bytes(model, config)
    expected = []
    for i, kind in enumerate(config.layer_types):
        mixer = ("linear_attn.in_proj", "linear_attn.out_proj") if kind == "linear_attention" else \
            ("self_attn.qkv_proj", "self_attn.o_proj")
        expected += [_bytes_named(model, f"layers.{i}.{m}.") for m in mixer]
    expected.append(_bytes_named(model, "lm_head."))
    assert [b for _, b in rows] == expected
    assert rows[0][0].startswith("GEMV: GDN in_proj") and rows[-1][0] == "GEMV: lm_head"
    assert all(b > 0 for b in expected)


@pytest.mark.parametrize("batch, tokens, passes", [(1, 1, 2), (3, 1, 2), (1, 4, 3), (1000, 1, 2)])
def test_kind_bytes_count_hit_experts_state_and_kv(tiny, batch, tokens, passes):
    model, config, harness = tiny
    context = 64
    kinds = kind_bytes(model, config, harness.manager, batch, context, tokens=tokens, state_passes=passes)
    hit = 1 - (1 - config.num_experts_per_tok / config.num_experts) ** (batch * tokens)
    gate_up = hit * _bytes_named(model, "mlp.experts.gate_up") + _bytes_named(model, "mlp.shared_expert.gate_up_proj")
    down = hit * _bytes_named(model, "mlp.experts.down") + _bytes_named(model, "mlp.shared_expert.down_proj")
    assert kinds[KERNEL_ROWS["gate_up_mma_kernel"]] == pytest.approx(gate_up)
    assert kinds[KERNEL_ROWS["down_mma_kernel"]] == pytest.approx(down)
    assert kinds[KERNEL_ROWS["router_kernel"]] == _bytes_named(model, "mlp.gate")
    gdn_layers = config.layer_types.count("linear_attention")
    state = (config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
             * harness.manager.cache.state.recurrent[0].element_size())
    assert kinds[KERNEL_ROWS["gdn_recurrent_kernel"]] == passes * batch * gdn_layers * state
    kv = harness.manager.cache.kv
    attention_layers = config.layer_types.count("full_attention")
    per_token = 2 * config.num_kv_heads * config.head_dim * kv.k[kv.layers[0]].element_size()  # K and V
    assert kinds[KERNEL_ROWS["decode_attention_kernel"]] == batch * context * attention_layers * per_token
    if batch == 1000:  # every expert hit
        assert kinds[KERNEL_ROWS["gate_up_mma_kernel"]] == pytest.approx(
            _bytes_named(model, "mlp.experts.gate_up") + _bytes_named(model, "mlp.shared_expert.gate_up_proj"))


def test_shares_add_up_to_the_step_and_gemvs_take_their_projection(tiny):
    # A [0, 10]; B starts early (PDL) at 5, ends 12: adds 2; a gap, C [20, 25]: adds 13 (its wait too)
    kernels = [{"start_us": 0.0, "us": 10.0, "name": GEMV},
               {"start_us": 5.0, "us": 7.0, "name": _kernel("router_kernel")},
               {"start_us": 20.0, "us": 5.0, "name": GEMV},
               {"start_us": 21.0, "us": 1.0, "name": _kernel("kv_slots_kernel")}]  # inside C: adds nothing
    projections = [("GEMV: a", 100), ("GEMV: b", 300)]
    table = {r.row: r for r in step_table(kernels, projections, {KERNEL_ROWS["router_kernel"]: 24.0})}
    assert table["GEMV: a"].share_us == 10.0 and table["GEMV: a"].bytes == 100
    assert table[KERNEL_ROWS["router_kernel"]].share_us == 2.0 and table[KERNEL_ROWS["router_kernel"]].bytes == 24.0
    assert table["GEMV: b"].share_us == 13.0 and table["GEMV: b"].own_us == 5.0 and table["GEMV: b"].bytes == 300
    assert table[OTHER].share_us == 0.0 and table[OTHER].calls == 1
    assert sum(r.share_us for r in table.values()) == 25.0  # the span


def test_a_kind_whose_kernel_is_missing_keeps_its_bytes_in_a_row_of_no_calls():
    kernels = [{"start_us": 0.0, "us": 4.0, "name": GEMV}]
    table = step_table(kernels, [("GEMV: a", 100)], {KERNEL_ROWS["gdn_recurrent_kernel"]: 50.0})
    recurrent = KERNEL_ROWS["gdn_recurrent_kernel"]
    assert [(r.row, r.calls, r.bytes) for r in table] == [("GEMV: a", 1, 100), (recurrent, 0, 50.0)]
    assert f"| {recurrent} | 0 | - | 0.0 | 0.0 | - | - |" in markdown(table).splitlines()
    assert markdown(table).splitlines()[-1] == "| **step** | 1 | | 4.0 | 0.0 | 0.00 | |"


def test_cublas_kernels_of_16_bit_weights_form_their_own_row():
    kernels = [{"start_us": 0.0, "us": 3.0, "name": "nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"},
               {"start_us": 3.0, "us": 2.0, "name": "void gemv2T_kernel_val<int, int, __nv_bfloat16, float>(...)"},
               {"start_us": 5.0, "us": 1.0, "name": "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>(...)"},
               {"start_us": 6.0, "us": 1.0, "name": _kernel("silu_mul_kernel")}]
    table = {r.row: r for r in step_table(kernels, [], {})}
    assert (table[DENSE_GEMM].calls, table[DENSE_GEMM].share_us, table[DENSE_GEMM].bytes) == (3, 6.0, 0)
    assert table[OTHER].calls == 1


def test_gemvs_form_one_row_where_their_count_differs_from_the_projections():
    kernels = [{"start_us": 0.0, "us": 4.0, "name": GEMV}, {"start_us": 4.0, "us": 4.0, "name": GEMV}]
    table = step_table(kernels, [("GEMV: a", 100), ("GEMV: b", 300), ("GEMV: c", 5)], {})
    assert [(r.row, r.calls, r.bytes, r.share_us) for r in table] == [("GEMV: all projections", 2, 405, 8.0)]


def test_compare_sets_each_build_against_the_first_kind_by_kind():
    main = [[KindRow("GEMV: a", 1, 10.0, 10.0, 100), KindRow("router", 1, 5.0, 4.0)],
            [KindRow("GEMV: a", 1, 10.0, 12.0, 100), KindRow("router", 1, 5.0, 4.0)]]  # mean 11
    patch = [[KindRow("GEMV: a", 1, 9.0, 9.9, 100), KindRow("router", 1, 5.0, 4.4), KindRow("new kind", 1, 1.0, 1.0)]]
    lines = compare({"main": main, "patch": patch}).splitlines()
    assert lines[0] == "| kernel kind (us of the step) | main | patch |"
    assert lines[2] == "| GEMV: a | 11.0 | 9.9 (-10.0%) |"
    assert lines[3] == "| router | 4.0 | 4.4 (+10.0%) |"
    assert lines[4] == "| new kind | 0.0 | 1.0 |"  # no reference: no ratio
    assert lines[5] == "| **step** | 15.0 | 15.3 (+2.0%) |"


def test_compare_script_groups_files_by_run_and_puts_the_base_first(tmp_path):
    def write(name: str, share: float) -> None:
        table = [vars(KindRow("router", 1, share, share))]
        (tmp_path / name).write_text(json.dumps({"step_table": table}))

    write("step_qwen3.6-35b-a3b_b1_a-patch_round1.json", 6.0)
    write("step_qwen3.6-35b-a3b_b1_main_round1.json", 4.0)
    write("step_qwen3.6-35b-a3b_b1_main_round2.json", 6.0)
    write("step_qwen3.6-35b-a3b_b8_main_round1.json", 9.0)
    (tmp_path / "step_qwen3.6-35b-a3b_b8_x_round1.json").write_text(json.dumps({"step_table": None}))
    script = Path(__file__).resolve().parent.parent / "scripts" / "compare_step_tables.py"
    run = subprocess.run([sys.executable, str(script), *sorted(str(p) for p in tmp_path.iterdir())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "step_qwen3.6-35b-a3b_b8_x_round1.json: no step table" in run.stderr
    b1, b8 = run.stdout.strip().split("\n\n")
    assert b1.splitlines()[:1] == ["step_qwen3.6-35b-a3b_b1:"]
    assert "| kernel kind (us of the step) | main | a-patch |" in b1
    assert "| router | 5.0 | 6.0 (+20.0%) |" in b1
    assert "| router | 9.0 |" in b8


def test_compare_script_takes_a_verify_profiles_two_tables(tmp_path):
    def write(name: str, decode: float, verify: float) -> None:
        tables = {"decode step": [vars(KindRow("router", 1, decode, decode))],
                  "K = 3 verify + commit": [vars(KindRow("router", 1, verify, verify))]}
        (tmp_path / name).write_text(json.dumps({"step_tables": tables}))

    write("verify_b1_main_round1.json", 4.0, 8.0)
    write("verify_b1_patch_round1.json", 4.0, 6.0)
    script = Path(__file__).resolve().parent.parent / "scripts" / "compare_step_tables.py"
    run = subprocess.run([sys.executable, str(script), *sorted(str(p) for p in tmp_path.iterdir()),
                          str(tmp_path / "step_none_b1_main_round1.json")],  # a glob that matched nothing
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "step_none_b1_main_round1.json: no step table" in run.stderr
    decode, verify = run.stdout.strip().split("\n\n")
    assert decode.splitlines()[0] == "verify_b1 decode step:" and "| router | 4.0 | 4.0 (+0.0%) |" in decode
    assert verify.splitlines()[0] == "verify_b1 K = 3 verify + commit:" and "| router | 8.0 | 6.0 (-25.0%) |" in verify
