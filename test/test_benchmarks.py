"""The benchmark suite runs end to end as a user runs it (small: two contenders at world size 2)
and writes its JSON, Markdown table and chart; the figures themselves live in benchmarks/results."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_run_writes_json_table_and_chart(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--contenders", "xla_fsdp,fsdp2",
                           "--world_sizes", "2", "--skip_consolidation", "--out_dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (json_path,) = tmp_path.glob("*.json")
    assert json_path.name == "suite-quick.json"
    data = json.loads(json_path.read_text())
    rows = {r["contender"]: r for r in data["rows"]["transformer"]}
    assert set(rows) == {"xla_fsdp", "fsdp2"}
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["median_step_s"] > 0 and len(row["step_times"]) == data["steps"]
    ours = rows["xla_fsdp"]
    ideal = ours["param_bytes"] * 4 / 2                      # params + grads + AdamW state, over 2 ranks
    assert ideal <= ours["state_bytes_max"] <= 1.02 * ideal
    assert 0 < ours["collective_bytes_per_step"] <= 3.05 * ours["param_bytes"]
    # same data, same seed: both contenders start from the same loss
    assert abs(ours["losses"][0] - rows["fsdp2"]["losses"][0]) < 1e-4
    table = json_path.with_suffix(".md").read_text()
    assert "| xla_fsdp | gloo | 2 |" in table and "## Targets" in table
    assert json_path.with_suffix(".png").stat().st_size > 10_000


def test_world_size_1_contenders_interleaved_in_one_process_train_identically():
    """benchmarks.overhead (the ws-1 overhead targets): every contender steps in turn in one process
    and, from the same seed and batches, reports the unwrapped model's losses."""
    from benchmarks.workloads import QUICK
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "gloo",
                           json.dumps(QUICK["transformer"].describe()), "1", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"unwrapped", "xla_fsdp", "xla_fsdp flat", "fsdp1"}
    for name, c in result.items():
        assert len(c["times"]) == 3 and len(c["losses"]) == 4 and c["ratio_to_plain"] > 0, name
        assert c["max_loss_diff_to_plain"] <= 1e-5, (name, c["losses"], result["unwrapped"]["losses"])


def test_compared_contenders_run_adjacent_and_alternate_who_goes_first():
    from benchmarks.run import PLAN, _reversed_within_groups, side_by_side

    jobs = side_by_side(["transformer", "resnet18"], PLAN, [1, 2, 4])
    assert len(jobs) == len(set(jobs)) == 2 * sum(len(wss) for _, wss in PLAN)
    later = _reversed_within_groups(jobs)
    assert sorted(later) == sorted(jobs)
    # each (workload, world size) is one contiguous block in both orders, reversed in the second
    for order in (jobs, later):
        keys = [(wl, ws) for wl, _, ws in order]
        assert all(keys.index(k) + keys.count(k) - 1 == len(keys) - 1 - keys[::-1].index(k) for k in keys)
    ws4 = [c for wl, c, ws in jobs if (wl, ws) == ("resnet18", 4)]
    assert [c for wl, c, ws in later if (wl, ws) == ("resnet18", 4)] == ws4[::-1]
    assert ws4.index("xla_fsdp_xla") < ws4.index("torchxla_fsdp")


def test_targets_leave_out_comparisons_not_run_but_show_failed_ones_as_missed():
    from benchmarks.report import floor, targets

    def row(contender, ws, step_s=None, peak_mib=1000.0):
        r = {"contender": contender, "ws": ws, "param_bytes": 400, "state_bytes_max": 600,
             "collective_bytes_per_step": 1000, "new_compiles_after_step2": 0, "peak_rss_mib_max": peak_mib}
        if step_s is None:
            r["error"] = "timed out after 900 s"
        else:
            r["median_step_s"] = step_s
        return r

    # a subset run: XLA contenders only, torch_xla failed at ws 4
    rows = [row("xla_fsdp_xla", 2, 0.9, peak_mib=1100.0), row("torchxla_fsdp", 2, 1.0), row("xla_fsdp_xla", 4, 2.0),
            row("torchxla_fsdp", 4)]
    found = {name: (value, met) for _, name, value, _, met in
             targets({"rows": {"resnet18": rows}, "workloads": {"resnet18": {"kind": "resnet"}}})}
    assert abs(found["XLA:CPU ws2 step time / torch_xla XlaFSDP"][0] - 0.9) < 1e-12
    assert found["XLA:CPU ws2 step time / torch_xla XlaFSDP"][1]
    # peak memory is a target of its own: 10 % more than torch_xla misses it though the step is faster
    assert found["XLA:CPU ws2 peak memory / torch_xla XlaFSDP"] == (1.1, False)
    assert found["XLA:CPU ws4 step time / torch_xla XlaFSDP"] == (None, False)
    assert found["XLA:CPU ws4 peak memory / torch_xla XlaFSDP"] == (None, False)
    assert not any("gloo" in name or "per-parameter" in name or "ws1" in name for name in found)

    # the default layout's step bound is 0.90; the floor (no FSDP at all) is reported beside it
    rows = [row("xla_fsdp_xla_perparam", 2, 0.92, peak_mib=950.0), row("torchxla_fsdp_perparam", 2, 1.0),
            row("xla_plain", 2, 0.88)]
    data = {"rows": {"resnet18": rows}, "workloads": {"resnet18": {"kind": "resnet"}}}
    found = {name: (value, bound, met) for _, name, value, bound, met in targets(data)}
    step = found["XLA:CPU ws2 step time / torch_xla XlaFSDP, default per-parameter layout"]
    assert step[1:] == ("<= 0.90", False) and abs(step[0] - 0.92) < 1e-12
    assert found["XLA:CPU ws2 peak memory / torch_xla XlaFSDP, default per-parameter layout"] == (0.95, "<= 1.00", True)
    [(wl, ws, plain_over_peer, ours_over_plain)] = floor(data)
    assert (wl, ws) == ("resnet18", 2)
    assert abs(plain_over_peer - 0.88) < 1e-12 and abs(ours_over_plain - 0.92 / 0.88) < 1e-12


def test_round_by_round_ratios_pair_each_rounds_steps_and_skip_rows_with_a_failed_round():
    from benchmarks.report import per_round_ratios

    ours = {"rounds": 2, "ok_rounds": 2, "step_times": [1.0, 1.2, 1.1, 3.0, 2.8, 2.9]}
    peer = {"rounds": 2, "ok_rounds": 2, "step_times": [2.0, 2.2, 2.4, 3.0, 3.1, 3.2]}
    assert per_round_ratios(ours, peer, steps=3) == [1.1 / 2.2, 2.9 / 3.1]
    assert per_round_ratios(ours, dict(peer, ok_rounds=1, step_times=peer["step_times"][:3]), steps=3) is None


def test_the_chart_draws_every_contender_of_ours_red_one_world_size_per_panel(tmp_path):
    """Before: our SPMD contender was grey under a title saying ours are red, and a panel held 28 bars.
    Each workload and world size is a row of two panels: step time and peak memory."""
    from benchmarks.report import FAMILY, chart, is_ours
    assert sorted(c for c in FAMILY if is_ours(c)) == ["xla_fsdp", "xla_fsdp_fully_shard", "xla_fsdp_spmd",
                                                       "xla_fsdp_xla", "xla_fsdp_xla_perparam"]
    data = json.loads(open(os.path.join(ROOT, "benchmarks", "results", "suite.json")).read())
    chart(data, str(tmp_path / "suite.png"))
    import matplotlib.image
    assert matplotlib.image.imread(str(tmp_path / "suite.png")).shape[0] > 400
    per_panel = max(sum(1 for r in rows if r["ws"] == ws and "median_step_s" in r)
                    for rows in data["rows"].values() for ws in {r["ws"] for r in rows})
    assert per_panel <= 14, per_panel


def _worker(contender: str, out_dir, ws: int = 2) -> list:
    from benchmarks.workloads import QUICK
    spec = {"contender": contender, "ws": ws, "workload": QUICK["transformer"].describe(), "warmup": 2, "steps": 2,
            "port": 0}
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", json.dumps(spec), str(out_dir)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


@pytest.mark.xla
def test_torch_xlas_fsdp_collectives_stay_in_the_compiled_step_as_ours_do(tmp_path):
    """torch_xla's FSDP gives its collectives no channel id, so on XLA:CPU rank threads
    enable_xla_cpu_devices runs them as host exchanges (a sync and a device-to-host copy per rank and
    collective), which a TPU never does. The benchmark numbers them (benchmarks/contenders.py), so they
    stay in the step like ours: without that, this run makes 165.5 device-to-host copies per step (measured);
    with it only loss.item()'s, as ours, and the losses are ours."""
    runs = {}
    for contender in ("torchxla_fsdp_perparam", "xla_fsdp_xla_perparam", "xla_fsdp_fully_shard"):
        (tmp_path / contender).mkdir()
        runs[contender] = _worker(contender, tmp_path / contender)
    theirs, ours = runs["torchxla_fsdp_perparam"], runs["xla_fsdp_xla_perparam"]
    # the fully_shard contender (FSDP2's API) trains the same model: the same losses, graphs fixed too
    for a, b in zip(runs["xla_fsdp_fully_shard"], ours):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5
    # one loss.item() per rank and step; the 2 rank threads count each other's
    for rank in theirs + ours + runs["xla_fsdp_fully_shard"]:
        # from windows that may be a step apart on a loaded machine (seen: 2.5); host exchanges: 165.5
        assert rank["host_transfers_per_step"] <= 5, rank["host_transfers_per_step"]
        assert rank["compiles_end"] == rank["compiles_step2"]  # the same graphs every step
        # backward ran in autograd's thread for the device, and its CPU time was measured there
        assert all(t is not None and 0 < t < h for t, h in zip(rank["backward_host_times"], rank["host_times"]))
    for a, b in zip(theirs, ours):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5
    # the tracing work, counted (no timing noise): each of ours traces under 0.9 of the ATen ops per
    # step of torch_xla's XlaFSDP (benchmarks.host_time's column; measured here 1320 and 1297 against
    # 1640; 8aac2df traced 0.99 of torch_xla's on the full shapes)
    for name in ("xla_fsdp_xla_perparam", "xla_fsdp_fully_shard"):
        assert runs[name][0]["xla_ops_per_step"] < 0.9 * theirs[0]["xla_ops_per_step"], (name, runs[name][0],
                                                                                           theirs[0])


def test_peak_memory_is_the_median_over_rounds_and_shown_round_by_round():
    """One process's peak moves by ~200 MiB from run to run: the row's figure is the median of its
    rounds' peaks, and the report lists each round's ratio beside it."""
    from benchmarks.report import markdown
    from benchmarks.run import summarize

    def run(peak, step_s=1.0):
        rank = {"times": [step_s] * 2, "losses": [1.0, 0.9], "state_bytes": 10, "param_bytes": 40,
                "peak_rss_mib": peak, "collective_bytes_per_step": 100, "compiles_step2": 3, "compiles_end": 3}
        return {"ranks": [rank, dict(rank, peak_rss_mib=peak - 50)], "error": None}

    ours = summarize("xla_fsdp_xla_perparam", 2, [run(1000), run(1300), run(1100)])
    peer = summarize("torchxla_fsdp_perparam", 2, [run(1000), run(1000), run(1250)])
    assert ours["peak_rss_mib_rounds"] == [1000, 1300, 1100] and ours["peak_rss_mib_max"] == 1100
    data = {"date": "today", "quick": False, "machine": {"cpus": 2}, "steps": 2, "rounds": 3, "warmup": 1,
            "workloads": {"resnet18": {"kind": "resnet", "batch": 8, "image": 64, "classes": 100}},
            "rows": {"resnet18": [ours, peer]}}
    text = markdown(data)
    assert "| resnet18 | 2 | xla_fsdp_xla_perparam / torchxla_fsdp_perparam | 1.100 | 1.000, 1.300, 0.880 |" in text
    assert ("| resnet18 | XLA:CPU ws2 peak memory / torch_xla XlaFSDP, default per-parameter layout | 1.100 | "
            "<= 1.00 | NO |") in text


@pytest.mark.xla
def test_step_buffers_per_device_default_layout_at_most_torch_xlas():
    """benchmarks.step_buffers reads XLA's buffer assignment of each contender's compiled step (the
    device memory a TPU would hold). ResNet-18 (quick shapes) at ws 2 in the default layout: xla_fsdp
    holds no more than torch_xla's XlaFSDP. Keeping the unit that ends forward last gathered for
    backward (what eager transports do) made it hold one unit more."""
    from benchmarks.step_buffers import largest_program_bytes, measure, table
    from benchmarks.workloads import QUICK
    rows = [measure(c, 2, "resnet18", QUICK) for c in ("xla_fsdp_xla_perparam", "torchxla_fsdp_perparam")]
    assert all(r["error"] is None and r["step_bytes_per_device"] for r in rows), rows
    ours, theirs = (r["step_bytes_per_device"] for r in rows)
    assert ours <= theirs, (ours, theirs)
    assert "| resnet18 | 2 | per-parameter (default) |" in table(rows)
    assert largest_program_bytes("/nonexistent") is None


@pytest.mark.xla
def test_reshard_and_prefetch_settings_move_gathers_and_memory_as_fsdp2s_do(tmp_path):
    """benchmarks.reshard at ws 2 (quick transformer): reshard_after_forward=False on the blocks (ZeRO-2)
    gathers less and holds more than True (ZeRO-3), on XLA (xla_fsdp.fully_shard: all-gathers in the
    compiled step, device bytes of the step) as with PyTorch's fully_shard on gloo (all-gather calls),
    with the same collective bytes over parameter bytes on both sides and the same losses. Prefetch lists
    move gathers earlier, not their number (test_fsdp2 checks the order); on XLA the compiled step's
    device bytes stay within 2% (XLA's scheduler places the gathers; measured +1.1% on these shapes,
    -0.1% on the full ones)."""
    from benchmarks.reshard import main
    main(["--world_sizes", "2", "--quick", "--out", str(tmp_path / "reshard")])
    rows = {r["contender"]: r for r in json.load(open(tmp_path / "reshard.json"))["rows"]}
    assert all(r["error"] is None for r in rows.values()), rows
    ours, ours2, ours_p, theirs, theirs2, theirs_p = (rows[c] for c in (
        "xla_fsdp_fully_shard", "xla_fsdp_fully_shard_zero2", "xla_fsdp_fully_shard_prefetch2",
        "fsdp2", "fsdp2_zero2", "fsdp2_prefetch2"))
    assert ours["compiled_all_gathers"] > ours2["compiled_all_gathers"] > 0
    assert ours["step_bytes_per_device"] < ours2["step_bytes_per_device"]
    assert theirs["all_gathers_per_step"] > theirs2["all_gathers_per_step"] > 0
    assert ours_p["compiled_all_gathers"] == ours["compiled_all_gathers"]
    assert ours_p["all_gathers_per_step"] == ours["all_gathers_per_step"]
    assert theirs_p["all_gathers_per_step"] == theirs["all_gathers_per_step"]
    assert abs(ours_p["step_bytes_per_device"] / ours["step_bytes_per_device"] - 1) <= 0.02
    for a, b in ((ours, theirs), (ours2, theirs2), (ours_p, theirs_p)):
        assert abs(a["collective_bytes_per_step"] / a["param_bytes"] - b["collective_bytes_per_step"]
                   / b["param_bytes"]) < 0.01
    for a, b, tol in ((ours, ours2, 1e-5), (ours, ours_p, 1e-5), (theirs, theirs2, 1e-5), (theirs, theirs_p, 1e-5),
                      (ours, theirs, 1e-4)):  # XLA:CPU vs eager CPU
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= tol
    text = open(tmp_path / "reshard.md").read()
    assert "| XLA:CPU, xla_fsdp.fully_shard | 2 | False |" in text and "NO |" not in text
    assert "| gloo, PyTorch's fully_shard | 2 | True, prefetch 2 |" in text


def test_against_commit_exports_the_other_checkout_and_pairs_rounds(tmp_path):
    """``benchmarks.against_commit``: the other commit's package is exported (it runs from there) and
    measured by this checkout's benchmark code, and each round's figures are paired with the same round's."""
    from benchmarks.against_commit import export, table

    measure = tmp_path / "measure"
    (measure / "results").mkdir(parents=True)
    (measure / "worker.py").write_text("# this checkout's worker\n")
    other = export("HEAD", str(tmp_path / "out"), measure_from=str(measure))
    assert os.path.isfile(os.path.join(other, "xla_fsdp", "__init__.py"))
    # the same measure on both sides: the commit's own benchmark code is replaced, results left out
    assert sorted(os.listdir(os.path.join(other, "benchmarks"))) == ["worker.py"]
    assert (tmp_path / "out" / "checkout" / "benchmarks" / "worker.py").read_text() == "# this checkout's worker\n"
    figures = {"xla_fsdp_xla_perparam": {"this": {"step": [1.0, 2.0], "host": [0.5, None], "ops": [10.0, 12.0]},
                                         "other": {"step": [2.0, 2.0], "host": [0.25, 0.3], "ops": [20.0, None]}}}
    lines = table({"figures": figures, "device_bytes": {"xla_fsdp_xla_perparam": {"this": 2**20, "other": 2**21}}},
                  "abc")
    row = lines[-1]
    assert "| 0.750 (0.500, 1.000) |" in row  # step: per round, pooled as their median
    assert "| 2.000 (2.000) |" in row  # host: the round with a failed run is left out
    assert row.endswith("| 1.00 / 2.00 | 11 / 20 |")  # device bytes; ops traced, median of the rounds run


def test_backward_thread_time_is_zero_where_backward_runs_in_the_calling_thread():
    """Eager CPU: autograd runs backward in the calling thread, whose CPU time already holds it."""
    import torch

    from benchmarks.measure import BackwardThreadTime
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    clock = BackwardThreadTime(loss)
    loss.backward()
    assert clock.seconds == 0.0


def test_step_cut_table_pairs_each_round_with_its_own_sync_run_and_flags_other_losses():
    """``benchmarks.step_cut``: totals and steady steps over the same round's ``own_sync`` run; the
    steady step is the median of the second half (the first steps compile); a failed run is shown."""
    from benchmarks.step_cut import steady_step, table

    def run(total, steps, losses=(1.0, 0.5)):
        return {"total_s": total, "step_times": steps, "losses": list(losses), "compiles": 3}
    assert steady_step(run(1, [9.0, 8.0, 1.0, 3.0])) == 2.0
    runs = {"as_written": [run(10.0, [5, 5, 1, 1]), run(12.0, [5, 5, 2, 2])],
            "own_sync": [run(10.0, [5, 5, 1, 1]), run(10.0, [5, 5, 1, 1])],
            "cut_off": [run(40.0, [5, 5, 9, 9], losses=(1.0, 0.7)), {"error": "exit 1"}]}
    lines = {line.split(" | ")[0]: line for line in table(runs)[2:]}
    assert "| 1.10 (1.00, 1.20) |" in lines["| as_written"]  # total, per round
    assert "| 1.50 (1.00, 2.00) |" in lines["| as_written"]  # steady step, per round
    assert lines["| as_written"].endswith("| 3 | True |")
    assert "| 4.00 (4.00) |" in lines["| cut_off"]  # the failed round is left out of the ratios
    assert lines["| cut_off"].endswith("| False |")  # other losses than own_sync's


@pytest.mark.xla
def test_pretrained_load_runs_every_way_and_each_loads_its_share_of_the_same_values(tmp_path):
    """benchmarks.pretrained_load end to end, small (world size 2): the three gloo ways and the two XLA:CPU
    ways all load the same values (the benchmark exits non-zero otherwise), each sharded rank holds exactly
    its share of the model, and the table is written."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    out = tmp_path / "pretrained_load"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pretrained_load", "--hidden", "256", "--layers", "4",
                           "--world_size", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    ways = {row["way"]: row for row in data["ways"]}
    assert set(ways) == {"xla_fsdp", "full_copy", "fsdp2_broadcast", "xla_fsdp_on_xla", "full_copy_on_xla"}
    assert data["model_bytes"] == 256 * 256 * 4 * 2  # bf16
    for row in ways.values():
        assert row["seconds"] >= row["load_seconds"] > 0
        (run,) = row["rounds"]
        assert run["own_bytes"] == data["model_bytes"] // 2  # every way ends sharded: half the model per rank
    assert "| xla_fsdp_on_xla | xla |" in out.with_suffix(".md").read_text()


@pytest.mark.fast
def test_the_compile_exponent_is_the_slope_of_seconds_against_depth_on_logs():
    from benchmarks.compile_time import exponent
    assert abs(exponent({d: {"compile_s": 3.0 * d ** 1.5} for d in (2, 4, 8, 16)}) - 1.5) < 1e-9
    assert exponent({2: {"compile_s": 1.0}, 4: {"error": "x"}}) is None  # one point: no fit


@pytest.mark.xla
def test_compile_time_counts_each_graph_and_splits_the_step_by_phase(tmp_path):
    """Two depths of xla_fsdp's wrapper with the phases apart: every compilation counted, the backward's and
    the optimizer's seconds adding up to at most the total (the rest: the start's small graphs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    out = tmp_path / "ct"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--depths", "1", "2", "--steps", "2",
                           "--phases", "--contenders", "xla_fsdp wrapper", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "ct.json").read_text())
    for depth in ("1", "2"):
        row = data["rows"]["xla_fsdp wrapper"][depth]
        assert "error" not in row, row
        assert row["graphs"] >= 4 and row["compile_s"] > 0  # two steps, each two graphs
        assert 0 < row["backward_compile_s"] + row["optimizer_compile_s"] <= row["compile_s"] + 1e-9
    assert data["exponents"]["xla_fsdp wrapper"] is not None
    assert "| xla_fsdp wrapper |" in (tmp_path / "ct.md").read_text()
