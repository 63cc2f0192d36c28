"""Reports on SYNTHETIC fixtures, for what no public repository holds (tests/fixtures/real/README.md): a GPU that
runs a step behind the CPU, torch_npu's db export and memory_record.csv components, torch_npu's step_trace_time
timeline; and the collective-name classifier on names from real traces. Built here, named synthetic_*."""

from __future__ import annotations

import csv
import re
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import ctl
from ondemand_prof.report import build_report
from ondemand_prof.report.classify import comm_library, device_name, is_comm
from ondemand_prof.report.html import render_html
from ondemand_prof.report.text import render_text

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


def one_rank(path: Path) -> dict[str, Any]:
    report = build_report([path], workers=1)
    assert not report["problems"], report["problems"]
    (group,) = report["captures"]
    assert not group["failed"], group["failed"]
    (rank,) = group["ranks"]
    return rank


def synthetic_gpu_one_step_behind(path: Path) -> None:
    """CPU steps 10 and 11 of 1000 us each; every kernel runs during the CPU's next step (the CPU runs ahead).
    Step 10 launches a 400 us GEMM; step 11 a 300 us NCCL all-reduce and a 100 us GEMM after it. One more
    kernel (a memcpy at 2300 us) has no launch in the file."""
    ev: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#11", "pid": 1, "tid": 1, "ts": 1000, "dur": 1000},
    ]
    launches = [(100, 1), (1100, 2), (1200, 3)]  # (CPU time, correlation)
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t, "dur": 5,
            "args": {"correlation": c}} for t, c in launches]
    ev += [
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7, "ts": 1100, "dur": 400,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0, "tid": 9,
         "ts": 2100, "dur": 300, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7, "ts": 2400, "dur": 100,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 7, "ts": 2300,
         "dur": 50, "args": {"correlation": 99}},
    ]
    path.write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": ev}))


def test_synthetic_kernels_belong_to_the_step_that_launched_them(tmp_path: Path) -> None:
    synthetic_gpu_one_step_behind(tmp_path / "synthetic_rank0.json")
    s10, s11 = one_rank(tmp_path / "synthetic_rank0.json")["steps"]
    # by launch: step 10 ran the 400 us GEMM; its device window lasts until step 11's first kernel (2100)
    assert (s10["kernel_ms"], s10["window_ms"], s10["compute_ms"], s10["comm_ms"], s10["idle_ms"]) == pytest.approx(
        (0.4, 1.0, 0.4, 0.0, 0.6))
    # step 11: all-reduce 2100-2400 exposed, GEMM 2400-2500, the memcpy without launch at 2300-2350 (counted by
    # time: it overlaps the all-reduce)
    assert (s11["kernel_ms"], s11["window_ms"], s11["compute_ms"], s11["comm_ms"], s11["overlap_ms"],
            s11["idle_ms"]) == pytest.approx((0.4, 0.4, 0.1, 0.25, 0.05, 0.0))
    # clipping kernels to the CPU steps' spans, as before, would have given step 10 no device time at all and
    # step 11 the GEMM of step 10 (1100-1500): the fixture tells the two rules apart
    clipped_10 = sum(max(0, min(e, 1000) - max(s, 0)) for s, e in ((1100, 1500), (2100, 2400), (2400, 2500)))
    assert clipped_10 == 0 and s10["kernel_ms"] > 0


# ----------------------------------------------------------------------------------------------------------
# torch_npu

NPU_TABLES = {  # torch_npu's TableColumnsManager (the columns we read, and a few more)
    "STRING_IDS": "id INTEGER PRIMARY KEY, value TEXT",
    "STEP_TIME": "id INTEGER, startNs INTEGER, endNs INTEGER",
    "PYTORCH_API": "startNs INTEGER, endNs INTEGER, globalTid INTEGER, connectionId INTEGER, name INTEGER, "
                   "sequenceNumber INTEGER, fwdThreadId INTEGER, inputDtypes INTEGER, inputShapes INTEGER, "
                   "callchainId INTEGER, type INTEGER",
    "CANN_API": "startNs INTEGER, endNs INTEGER, type INTEGER, globalTid INTEGER, connectionId INTEGER, name INTEGER",
    "TASK": "startNs INTEGER, endNs INTEGER, deviceId INTEGER, connectionId INTEGER, globalTaskId INTEGER, "
            "globalPid INTEGER, taskType INTEGER, contextId INTEGER, streamId INTEGER, taskId INTEGER, "
            "modelId INTEGER",
    "COMPUTE_TASK_INFO": "name INTEGER, globalTaskId INTEGER, blockDim INTEGER, mixBlockDim INTEGER, "
                         "taskType INTEGER, opType INTEGER",
    "COMMUNICATION_OP": "opName INTEGER, startNs INTEGER, endNs INTEGER, connectionId INTEGER, groupName INTEGER, "
                        "opId INTEGER, relay INTEGER, retry INTEGER, dataType INTEGER, algType INTEGER, "
                        "count INTEGER, opType INTEGER, deviceId INTEGER",
    "MEMORY_RECORD": "component INTEGER, timestamp INTEGER, totalAllocated INTEGER, totalReserved INTEGER, "
                     "totalActive INTEGER, streamPtr INTEGER, deviceId INTEGER",
    "RANK_DEVICE_MAP": "rankId INTEGER, deviceId INTEGER",
}
MS = 1_000_000  # ns


def synthetic_npu_db(path: Path, rank: int) -> None:
    """Two steps of 10 ms; per step a 4 ms MatMul launched 1 ms in, then a 3 ms hcom all-reduce from 4.5 ms (0.5 ms
    of it overlapped by a 1 ms Add); memory: PTA up to 600 MB, GE 100 MB, PTA+GE their sum, APP 900 MB."""
    con = sqlite3.connect(path)
    for table, cols in NPU_TABLES.items():
        con.execute(f"CREATE TABLE {table} ({cols})")
    strings = ["MatMulV2", "Add", "hcom_allReduce__12_0_1", "aten::mm", "PTA", "GE", "PTA+GE", "APP", "BroadcastTo"]
    con.executemany("INSERT INTO STRING_IDS VALUES (?, ?)", list(enumerate(strings)))
    sid = {s: i for i, s in enumerate(strings)}
    task = 0
    for step in (1, 2):
        t0 = step * 20 * MS  # 10 ms steps with a 10 ms gap between them
        con.execute("INSERT INTO STEP_TIME VALUES (?, ?, ?)", (step, t0, t0 + 10 * MS))
        con.execute("INSERT INTO PYTORCH_API (startNs, endNs, globalTid, name) VALUES (?, ?, 7, ?)",
                    (t0 + MS, t0 + 2 * MS, sid["aten::mm"]))
        for name, start, dur in (("MatMulV2", 1, 4), ("Add", 7, 1), ("BroadcastTo", 8, 0.5)):
            task += 1
            conn = 100 * step + task
            con.execute("INSERT INTO CANN_API (startNs, endNs, connectionId) VALUES (?, ?, ?)",
                        (t0 + MS, t0 + MS + 1000, conn))
            con.execute("INSERT INTO TASK (startNs, endNs, connectionId, globalTaskId) VALUES (?, ?, ?, ?)",
                        (t0 + int(start * MS), t0 + int((start + dur) * MS), conn, task))
            con.execute("INSERT INTO COMPUTE_TASK_INFO (name, globalTaskId, opType) VALUES (?, ?, ?)",
                        (sid[name], task, sid[name]))
        con.execute("INSERT INTO COMMUNICATION_OP (opName, startNs, endNs, connectionId) VALUES (?, ?, ?, ?)",
                    (sid["hcom_allReduce__12_0_1"], t0 + int(4.5 * MS), t0 + int(7.5 * MS), -1))
    memory = [("PTA", 1, 200), ("GE", 1, 100), ("PTA+GE", 1, 300), ("APP", 1, 900), ("PTA", 2, 600),
              ("PTA+GE", 2, 700), ("PTA", 3, 100), ("PTA+GE", 3, 200)]
    con.executemany("INSERT INTO MEMORY_RECORD VALUES (?, ?, ?, ?, 0, 0, 0)",
                    [(sid[c], t * MS, mb * 2**20, 2 * mb * 2**20) for c, t, mb in memory])
    con.execute("INSERT INTO RANK_DEVICE_MAP VALUES (?, 0)", (rank,))
    con.commit()
    con.close()


def test_synthetic_torch_npu_db_export(tmp_path: Path) -> None:
    out = tmp_path / "node0_77_20250101000000000_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    synthetic_npu_db(out / "ascend_pytorch_profiler_3.db", rank=3)
    r = one_rank(out.parent)  # the directory of a db export
    assert r["rank"] == 3 and r["files_used"] == ["ascend_pytorch_profiler_3.db"]
    assert [s["step"] for s in r["steps"]] == [1, 2] and r["steps"][0]["dur_ms"] == pytest.approx(10.0)
    kernels = {k["name"]: k for k in r["top_kernels"]}
    assert kernels["hcom_allReduce_"]["comm"] and kernels["hcom_allReduce_"]["total_us"] == pytest.approx(6000)
    assert not kernels["BroadcastTo"]["comm"] and kernels["MatMulV2"]["calls"] == 2
    assert r["kernel_steps"] == {"by_launch": 6, "by_time": 2, "outside_steps": 0}
    s1 = r["steps"][0]  # window 1 .. 21 ms (step 2's first kernel); busy: MatMul 1-5, comm 4.5-7.5, Add 7-8, B 8-8.5
    assert (s1["window_ms"], s1["compute_ms"], s1["comm_ms"], s1["overlap_ms"], s1["idle_ms"]) == pytest.approx(
        (20.0, 4.5, 2.0, 0.5 + 0.5, 12.5))
    assert r["top_self"][0]["name"] == "aten::mm"
    mem = r["memory"]
    assert mem["series_device"] == "NPU:0 (PTA)" and [v for _, v in mem["series"]] == [200 * 2**20, 600 * 2**20,
                                                                                       100 * 2**20]
    peaks = {d["component"]: d["peak_allocated"] / 2**20 for d in mem["devices"]}
    assert peaks == {"PTA": 600, "PTA+GE": 700, "GE": 100, "APP": 900}
    assert mem["devices"][0]["component"] == "PTA"  # the allocator's first, the others listed
    # the db file on its own
    alone = one_rank(out / "ascend_pytorch_profiler_3.db")
    assert alone["steps"] == r["steps"] and alone["rank"] == 3
    text = render_text(build_report([out.parent], workers=1))
    assert re.search(r"NPU:0 +PTA +600.0", text) and "npu:None" not in text


def test_synthetic_torch_npu_memory_components_and_timeline(tmp_path: Path) -> None:
    out = tmp_path / "synthetic_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    with open(out / "memory_record.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Component", "Timestamp(us)", "Total Allocated(MB)", "Total Reserved(MB)", "Total Active(MB)",
                    "Stream Ptr", "Device Type"])
        for t, pta, ge in ((10, 100, 50), (20, 400, 50), (30, 250, 80), (40, 300, 80)):  # interleaved components
            w.writerows([["PTA", t, pta, 512, pta, "", "NPU:0"],
                         ["PTA+GE", t + 1, pta + ge, 600, pta + ge, "", "NPU:0"],
                         ["GE", t + 2, ge, ge, ge, "", "NPU:0"], ["APP", t + 3, 1000, 1000, 1000, "", "NPU:0"]])
    with open(out / "step_trace_time.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Device_id", "Step", "Computing", "Communication(Not Overlapped)", "Overlapped",
                    "Communication", "Free", "Stage", "Bubble", "Communication(Not Overlapped and Exclude Receive)",
                    "Preparing"])
        w.writerows([[0, 7, 9000, 1000, 2000, 3000, 1000, 0, 0, 1000, 0],
                     [0, 8, 9500, 500, 2000, 2500, 0, 0, 0, 500, 0]])
    r = one_rank(out.parent)
    mem = r["memory"]
    assert [v / 2**20 for _, v in mem["series"]] == [100, 400, 250, 300]  # PTA alone: no zig-zag
    assert mem["devices"][0]["peak_allocated"] == 400 * 2**20 and mem["devices"][0]["device"] == "NPU:0"
    assert {d["component"] for d in mem["devices"]} == {"PTA", "PTA+GE", "GE", "APP"}
    assert sum(r[f"{k}_pct"] for k in ("compute", "comm", "overlap", "idle")) == pytest.approx(100)
    page = render_html(build_report([out.parent], workers=1))
    assert 'id="timeline-c0"' in page and "No steps to draw" not in page and "laid end to end" in page


# ----------------------------------------------------------------------------------------------------------

# Real kernel and operator names, as traces carry them, with where each was read. DeepSeek's are copied from
# deepseek-ai/profile-data train.json @ 449602428a1b023acb8a505d4f34fef536535db6 (an H800 training rank, DeepEP
# internode); DeepEP's open-source ones and torch SymmetricMemory's from kernel tables of public trace analyses
# (SGLang / vLLM / TensorRT-LLM serving studies on GitHub) and the kernels' sources (deepseek-ai/DeepEP
# csrc/kernels, pytorch CUDASymmetricMemoryOps.cu: an anonymous namespace); MSCCL++'s as nvcc demangles the kernels
# declared in microsoft/mscclpp (apps/nccl/src/allreduce.hpp @ a707273^, src/core/include/execution_kernel.hpp).
REAL_COMM_NAMES = {
    "DeepEP": [
        "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, float*, bool const*, int4 "
        "const*, float const*, int4 const*, int4 const*, int const*, int const*, dpsk::ep::internode::SourceMeta "
        "const*, int const*, int const*, int const*, int, int, int, int, void*, int, int, void**, int, int, int, int, "
        "int*)",
        "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, dpsk::ep::internode::"
        "SourceMeta*, int4 const*, float const*, long const*, float const*, int*, int*, int*, int*, int const*, int "
        "const*, int const*, int const*, int, int, int, int, int, bool const*, void*, int, int, void**, int, int, int, "
        "int, int*)",
        "void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int*, int, int, int const*, int const*, "
        "int*, void*, void**, int**, int, int, int, int*, bool, int)",
        "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, long*, int, int const*, int*, int const*, "
        "int*, int, bool const*, int, int, int, int, int, int, int, int*, int*, int*, int*, void*, void**, int**, int, "
        "int, int*, int)",
        "void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int const*, int*, int, int, int, bool const*, "
        "int*, int*, int, int, void**, int**, int)",
        "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, int4 const*, "
        "float const*, long const*, float const*)",
        "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(__nv_bfloat16*, float*)",
        "void deep_ep::intranode::cached_notify_combine<8>(void**, int*, int, int, int, int**, int)",
        "void deep_ep::internode_ll::dispatch<true, 3, 10, 7168>(void*, float*, int*, long*, int*, void*, int*, "
        "void*, void const*, long const*, int*, int*, int*, int, int, int, int, int, int, int, int)",
        "void deep_ep::internode_ll::combine<3, 10, 7168, 9>(void*, void*, int*, void*, void const*, long const*, "
        "float const*, int const*, long const*, int*, int, int*, int, int, int, int, int, int, int, int, bool)",
    ],
    "SymmetricMemory": [
        "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, "
        "unsigned int**, unsigned long, unsigned long)",
        "void (anonymous namespace)::two_shot_all_reduce_kernel_inplace<c10::BFloat16, 16, 2>(c10::BFloat16**, "
        "unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
        "symm_mem::multimem_all_reduce_", "symm_mem::one_shot_all_reduce",
    ],
    "NVSHMEM": ["void nvshmemi_reduce_kernel<float, (rdxn_ops)0>(int, int, int, float*, float const*, unsigned long, "
                "float*, long*)", "nvshmemi_proxy_quiet_entrypoint()"],
    "MSCCL++": [
        "void allreduce7<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, mscclpp::DeviceHandle<"
        "mscclpp::MemoryChannel>*, unsigned long, unsigned long, int, int, int, unsigned long, unsigned int)",
        "void mscclpp::executionKernel<__half, mscclpp::LL16Packet, false>(int, __half*, __half*, __half*, unsigned "
        "int, unsigned int, mscclpp::DeviceExecutionPlan*)",
    ],
    "NCCL/RCCL": ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)",
                  "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*)", "nccl:all_reduce",
                  "void ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)"],
    "HCCL": ["hcom_allReduce__885_0_1", "hcom_broadcast_", "HcclAllReduce"],
    "gloo": ["gloo:all_reduce", "gloo:broadcast"],
    "c10d": ["c10d::allreduce_", "c10d::broadcast_", "_c10d_functional::all_gather_into_tensor",
             "_c10d_functional::wait_tensor", "record_param_comms"],
}
NOT_COMM = [
    "BroadcastTo", "aten::broadcast_to", "aten::broadcast_tensors", "AllReduceSum", "MatMulV2", "aten::all",
    "void at::native::reduce_kernel<512, 1>", "Memcpy HtoD (Pageable -> Device)", "ReduceSumD",
    "record_param_comms_fake", "my_barrier",
    # DeepEP's routing arithmetic (no transfer), from the same DeepSeek trace; a CUB scan in a look-alike namespace
    "void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int, int, int)",
    "void cdpsk::ep::CUB_DeviceScanKernel<int>(int*)",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>,"
    " unsigned int, 3, 64, 64>(int)",
    "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(int)",
]


def test_communication_libraries_by_real_kernel_names() -> None:
    assert {name: comm_library(name) for names in REAL_COMM_NAMES.values() for name in names} == {
        name: library for library, names in REAL_COMM_NAMES.items() for name in names}
    assert [n for n in NOT_COMM if is_comm(n)] == []


def synthetic_moe_rank(path: Path) -> None:
    """One 1000 us step with DeepSeek's real kernel names: a DeepEP dispatch (200 us) alone, a combine (300 us) under
    a grouped GEMM (400 us), a SymmetricMemory all-reduce (100 us) alone."""
    names = REAL_COMM_NAMES["DeepEP"]
    gemm = NOT_COMM[-1]
    kernels = [(names[1], 0, 200), (gemm, 300, 400), (names[0], 400, 300), (REAL_COMM_NAMES["SymmetricMemory"][0],
                                                                           800, 100)]
    ev: list[dict[str, Any]] = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
                                 "ts": 0, "dur": 1000}]
    ev += [{"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": t, "dur": d} for n, t, d in kernels]
    path.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 64}, "traceEvents": ev}))


def test_synthetic_moe_rank_counts_deepep_and_symmetric_memory(tmp_path: Path) -> None:
    """DeepEP and SymmetricMemory count as communication (HTA and our previous report called them compute), and
    the report says how much of each it counted."""
    synthetic_moe_rank(tmp_path / "synthetic_moe.json")
    r = one_rank(tmp_path / "synthetic_moe.json")
    (s,) = r["steps"]
    # window 0..900: dispatch 200 + all-reduce 100 alone (exposed 300), combine under the GEMM for 300 (overlap),
    # the GEMM alone for 100, idle 200 (200..300 and 700..800)
    assert (s["window_ms"], s["comm_ms"], s["overlap_ms"], s["compute_ms"], s["idle_ms"]) == pytest.approx(
        (0.9, 0.3, 0.3, 0.1, 0.2))
    assert [(lib["library"], lib["ms"], lib["count"]) for lib in r["comm_libraries"]] == [
        ("DeepEP", pytest.approx(0.5), 2), ("SymmetricMemory", pytest.approx(0.1), 1)]
    assert "communication counted: DeepEP 0.50 ms (2 kernels), SymmetricMemory 0.10 ms (1 kernel)" in render_text(
        build_report([tmp_path / "synthetic_moe.json"], workers=1))


def test_device_names_as_users_write_them() -> None:
    assert [device_name(1, 0), device_name(0, -1), device_name(20, 1), device_name("NPU:0", None),
            device_name(None, None)] == ["cuda:0", "CPU", "npu:1", "NPU:0", "unknown"]


def test_a_database_we_cannot_read_gets_one_line(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE things (x)")
    con.close()
    res = ctl(tmp_path, "report", str(db))
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    assert "neither our profile.db nor torch_npu's" in res.stdout
