"""Sharded checkpoints: round trips, resizing, resume, full state dicts, crash safety, bad input."""
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import harness
import models
from ranks import run_multiprocess
from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli
from xla_fsdp.resize import main as resize_cli

ROUND_TRIP = harness.ROUND_TRIP
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 8  # divisible by every world size used, so resumed runs see the same global batch


def consolidate(prefix, *extra):
    out = prefix + "_full.pth"
    assert consolidate_cli(["--ckpt_prefix", prefix, "--save_path", out, *extra]) == 0
    return torch.load(out, weights_only=True)


def assert_bit_exact(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_round_trip_is_bit_exact(transport, world_size):
    """consolidate(checkpoint) == the unsharded model's state dict, key for key, bit for bit: at save
    time against the original model; after training against the live model's gathered full state.
    (The session's shared run: the same training the equivalence tests compare.)"""
    results, prefix = harness.session_run(transport, world_size)
    for name in ROUND_TRIP:
        initial = consolidate(prefix.format(name=name) + "_init")["model"]
        assert_bit_exact(initial, models.make_model(harness.CONFIGS[name]["model"]).state_dict())
        # One file per shard: replicas (hybrid, NO_SHARD) write only their first copy.
        files = glob.glob(prefix.format(name=name) + "_rank-*.pth")
        assert len(files) == results[name][0]["metadata"]["world_size"], files
        final = consolidate(prefix.format(name=name), "--optimizer")
        assert_bit_exact(final["model"], results[name][0]["full"])  # gathered in-process, all ranks
        last = {k: v for k, v in results[name][world_size - 1]["full"].items()
                if "running_" not in k and "num_batches" not in k}  # BatchNorm statistics are per rank
        assert all(torch.equal(final["model"][k], v) for k, v in last.items())
        want_opt = results[name][0]["full_optim"]
        assert final["optimizer"]["param_groups"] == want_opt["param_groups"]
        for pname, st in want_opt["state"].items():
            assert_bit_exact(final["optimizer"]["state"][pname], st)


SEQ = ["seq_nested_adamw", "seq_nested_flat_adamw", "seq_groups_flat_adamw"]


def _plain_optimizer(name, model):
    """The optimizer a user builds for the unwrapped model: model.parameters(), or for the
    weight-decay groups the usual two groups, each in model order."""
    if harness.CONFIGS[name]["opt"] != "adamw_groups":
        return harness.make_optimizer(harness.CONFIGS[name]["opt"], model)
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if not harness.no_decay(n)]},
                              {"params": [p for n, p in named if harness.no_decay(n)], "weight_decay": 0.0}],
                             lr=1e-3, weight_decay=0.5, eps=1e-6)


def test_consolidated_optimizer_state_loads_into_the_plain_model(tmp_path):
    """The consolidated optimizer state loads into the unwrapped model's own
    optimizer with plain ``load_state_dict``: nn.Sequential with nested units for 0 and 2 (root owns
    4), per-parameter and flat, one group and the weight-decay groups, 2 gloo ranks, 3 steps. Every
    parameter gets its own moments (bit for bit, by name, against the state gathered from the
    sharded run), each group names its parameters (param_names) in model order, and one more step
    from the consolidated model and optimizer matches unsharded training (1e-5)."""
    steps, ws, per_rank = 3, 2, 4
    prefix = str(tmp_path / "{name}")
    results = harness.run_gloo(SEQ, ws, steps=steps, per_rank=per_rank, save_prefix=prefix, full_state=SEQ)
    failures = []
    for name in SEQ:
        cfg = harness.CONFIGS[name]
        out = prefix.format(name=name) + "_full.pth"
        proc = subprocess.run([sys.executable, "-m", "xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix",
                               prefix.format(name=name), "--optimizer", "--save_path", out],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.returncode == 0, proc.stderr
        full = torch.load(out, weights_only=True)
        gathered = results[name][0]["full_optim"]["state"]  # full_optim_state_dict: keyed by name
        model = models.make_model(cfg["model"], seed=1)  # other weights: the load must replace them
        model.load_state_dict(full["model"])
        opt = _plain_optimizer(name, model)
        group_names = [[n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
                       for g in opt.param_groups]
        opt.load_state_dict(full["optimizer"])
        named = list(model.named_parameters())
        exact = all(set(opt.state[p]) == set(gathered[n]) and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(gathered[n][f])) for f, v in opt.state[p].items())
            for n, p in named)
        got = {n: next((m for m, want in gathered.items() if want["exp_avg"].shape == opt.state[p]["exp_avg"].shape
                        and torch.equal(want["exp_avg"], opt.state[p]["exp_avg"])), None) for n, p in named}
        wrong = {n: m for n, m in got.items() if m != n}  # parameter: whose moments it got
        opt.zero_grad()  # one more step, on the global batch
        losses = [models.loss_fn(cfg["model"], model(x), y)
                  for x, y in (models.batch(cfg["model"], steps, r, per_rank) for r in range(ws))]
        torch.stack(losses).mean().backward()
        opt.step()
        ref = harness.train_reference(name, ws, steps=steps + 1, per_rank=per_rank)["state_dict"]
        worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in ref.items())
        print(f"{name}: moments of another parameter: {wrong or 'none'}; one more step within {worst:.2e} of "
              "unsharded training")
        groups = full["optimizer"]["param_groups"]
        saved_names = [g.get("param_names") for g in groups]
        if (wrong or not exact or worst > 1e-5 or saved_names != group_names
                or groups != results[name][0]["full_optim"]["param_groups"]):
            failures.append((name, wrong, worst, saved_names))
    assert not failures, failures
    # Files that do not record the order (torch_xla's, older ones): inferred from the names, with a warning.
    source, legacy = prefix.format(name=SEQ[0]), str(tmp_path / "legacy")
    for path in sorted(glob.glob(source + "_rank-*.pth")):
        ckpt = torch.load(path, weights_only=True)
        del ckpt["shard_metadata"]["model_param_order"]
        torch.save(ckpt, legacy + path[len(source):])
    with pytest.warns(UserWarning, match="do not record the model's parameter order"):
        inferred = consolidate(legacy, "--optimizer")["optimizer"]
    assert inferred["param_groups"] == torch.load(source + "_full.pth", weights_only=True)["optimizer"]["param_groups"]


class _OwnParamAfterChildren(torch.nn.Module):
    """named_parameters(): the root's own ``scale`` first though registered last, then depth first
    (``a.0``, ``a.1.0``, ``b``): neither the order of registration nor breadth first."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
        self.b = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


@pytest.mark.parametrize("name", ["seq_nested_adamw", "seq_groups_flat_adamw", "flatten_nested_adamw",
                                  "autowrap_type_lm_adamw", "autowrap_type_lm_flat_sgd", "tied_param_adamw",
                                  "tied_across_units_adamw", "tied_across_units_flat_sgd", "frozen_flat_adamw",
                                  "tiny_param_sgd", "convbn_sgd", "own_param_after_children"])
def test_metadata_records_the_unwrapped_models_parameter_order(name, gloo):
    """metadata['model_param_order'] == [n for n, _ in unwrapped.named_parameters()], whatever the
    units (nested, auto-wrapped, flat, tied within and across units, frozen, 0-d parameters)."""
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    if name == "own_param_after_children":
        make = _OwnParamAfterChildren
        def wrap(m):
            harness._wrap_children(m.a, ["1"], flatten_parameters=True)
            return FSDP(harness._wrap_children(m, ["b"]), flatten_parameters=True)
    else:
        make = functools.partial(models.make_model, harness.CONFIGS[name]["model"])
        wrap = harness.CONFIGS[name]["wrap"]
    want = [n for n, _ in make().named_parameters()]
    wrapped = wrap(make())
    assert wrapped.get_shard_metadata()["model_param_order"] == want


@pytest.mark.fast
def test_a_saved_rank_file_is_a_plain_checked_archive_with_its_extra(gloo, tmp_path):
    """The one rank-file writer (streamed, its zip CRC-32s filled in outside the GIL): the save's file passes
    zipfile's own check, loads with torch.load(weights_only=True), and gives back an ``extra`` holding
    tensors (a view into a larger one among them) and the optimizer state bit for bit."""
    import zipfile

    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    big = torch.arange(20.0)
    extra = {"rng": torch.get_rng_state(), "view": big[3:7], "nested": [{"t": torch.arange(4)}], "n": 3}
    path = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "ck"), extra=extra)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["extra"]["view"], big[3:7]) and saved["extra"]["view"].numel() == 4
    assert torch.equal(saved["extra"]["rng"], extra["rng"]) and saved["extra"]["n"] == 3
    assert torch.equal(saved["extra"]["nested"][0]["t"], torch.arange(4))
    want = opt.state_dict()
    for idx, st in want["state"].items():
        for field, v in st.items():
            assert torch.equal(saved["optimizer"]["state"][idx][field], v), (idx, field)
    assert saved["optimizer"]["param_groups"] == want["param_groups"]
    assert set(saved["shard_metadata"]["checksums"]["optimizer"]) == {
        f"{i}.{f}" for i, st in want["state"].items() for f in st}
    fresh = torch.optim.AdamW(model.parameters())
    assert xla_fsdp.load_sharded_checkpoint(model, fresh, str(tmp_path / "ck"))["n"] == 3


@pytest.mark.fast
def test_a_file_missing_a_listed_tensor_or_a_failed_save_leaves_nothing_behind(gloo, tmp_path):
    """A rank file whose optimizer state lost a tensor its metadata lists is refused at load, naming it (not
    resumed with fresh moments for that parameter); a save whose extra cannot be pickled raises and leaves
    no temporary file nor an open one."""
    import threading

    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import CheckpointError
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "ck"))
    saved = torch.load(path, weights_only=True)
    del saved["optimizer"]["state"][1]["exp_avg"]  # its checksum still listed in the metadata
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match=r"'1.exp_avg' listed in the metadata is missing"):
        xla_fsdp.load_sharded_checkpoint(model, torch.optim.AdamW(model.parameters()), str(tmp_path / "ck"))
    before = set(os.listdir(f"/proc/{os.getpid()}/fd"))
    with pytest.raises(CheckpointError, match="could not write"):
        xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "bad"), extra={"lock": threading.Lock()})
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp") or f.startswith("bad")]
    assert set(os.listdir(f"/proc/{os.getpid()}/fd")) <= before


RELEASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "release-0.1.0")


@pytest.mark.fast
def test_rank_files_of_the_last_release_still_load(gloo, tmp_path):
    """Two rank files written by xla_fsdp 0.1.0 (test/data/release-0.1.0, written_by.py says how) consolidate,
    resize and load (resized to one rank) with today's code: the model and its Adam moments are those of
    the same model trained the same step unsharded (1e-6), the extra comes back as saved."""
    import importlib.util
    import shutil

    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import full_optim_state_dict, full_state_dict
    spec = importlib.util.spec_from_file_location("written_by", os.path.join(RELEASE, "written_by.py"))
    written_by = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written_by)
    for name in os.listdir(RELEASE):
        if name.endswith(".pth"):
            shutil.copy(os.path.join(RELEASE, name), tmp_path / name)  # the tools write beside their input
    prefix = str(tmp_path / "release-0.1.0")
    plain = written_by.make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(written_by.batch()).square().mean().backward()  # the mean of the two ranks' losses
    plain_opt.step()
    want = dict(plain.named_parameters())
    moments = {n: plain_opt.state[p] for n, p in want.items()}

    def close(a, b):
        return (a.float() - b.float()).abs().max().item() <= 1e-6

    assert consolidate_cli(["--ckpt_prefix", prefix, "--optimizer"]) == 0
    full = torch.load(prefix + "_consolidated.pth", weights_only=True)
    assert all(close(full["model"][n], p) for n, p in want.items())
    assert all(close(full["optimizer"]["state"][n]["exp_avg_sq"], st["exp_avg_sq"]) for n, st in moments.items())
    assert resize_cli(["--ckpt_prefix", prefix, "--world_size", "1", "--out_prefix", str(tmp_path / "one")]) == 0
    for source in (prefix, str(tmp_path / "one")):  # resized while loading, and resized offline
        model = FSDP(written_by.make())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = xla_fsdp.load_sharded_checkpoint(model, opt, source)
        assert extra["step"] == 1 and torch.equal(extra["rng"], torch.arange(3))
        loaded = full_state_dict(model, rank0_only=False)
        assert all(close(loaded[n], p) for n, p in want.items()), source
        state = full_optim_state_dict(model, opt, rank0_only=False)["state"]
        assert all(close(state[n]["exp_avg"], st["exp_avg"]) for n, st in moments.items()), source


def test_inferred_parameter_order_of_files_that_do_not_record_it():
    from xla_fsdp.checkpoints.metadata import inferred_param_order
    assert inferred_param_order(["4.weight", "4.bias", "0.weight", "0.bias", "10.weight", "2.weight"]) == [
        "0.weight", "0.bias", "2.weight", "4.weight", "4.bias", "10.weight"]
    assert inferred_param_order(["head.w", "pos", "blocks.1.ln.b", "blocks.0.attn.w", "blocks.0.ln.b"]) == [
        "pos", "head.w", "blocks.0.attn.w", "blocks.0.ln.b", "blocks.1.ln.b"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """3 training steps at world sizes 1, 2 and 4 (global batch 8), each saved."""
    root = tmp_path_factory.mktemp("src")
    out = {}
    for n in (1, 2, 4):
        prefix = str(root / f"ws{n}_{{name}}")
        harness.run_gloo(["zero3_nested_adamw", "flatten_nested_adamw"], n, steps=3,
                         per_rank=GLOBAL_BATCH // n, save_prefix=prefix)
        out[n] = prefix
    return out


@pytest.mark.parametrize("n,m", [(2, 4), (4, 2), (4, 1), (1, 4)])
def test_resize_then_resume(sources, n, m, tmp_path):
    """consolidate(resize(ckpt, M)) == consolidate(ckpt), optimizer included; training resumed on M
    ranks continues the uninterrupted run (same global batch) within 1e-5; and resuming from the
    N-rank files directly (resized while loading) gives the same bits as from the offline resize."""
    resumed_prefix = str(tmp_path / "{name}_to_m")
    for name in ["zero3_nested_adamw", "flatten_nested_adamw"]:
        src = sources[n].format(name=name)
        dst = resumed_prefix.format(name=name)
        assert resize_cli(["--ckpt_prefix", src, "--world_size", str(m), "--out_prefix", dst]) == 0
        assert all(os.path.exists(harness_rank(dst, r, m)) for r in range(m))
        a, b = consolidate(src, "--optimizer"), consolidate(dst, "--optimizer")
        assert_bit_exact(b["model"], a["model"])
        for pname, st in a["optimizer"]["state"].items():
            assert_bit_exact(b["optimizer"]["state"][pname], st)
    names = ["zero3_nested_adamw", "flatten_nested_adamw"]
    # the same resumption straight from the world-size-N files: load_sharded_checkpoint resizes while loading
    resumed = harness.run_gloo(names + [x + "@direct" for x in names], m, steps=3, start=3, per_rank=GLOBAL_BATCH // m,
                               load_prefix={"": resumed_prefix, "direct": sources[n]})
    for name in names:
        for r in range(m):  # load-time resizing == offline resize + load, bit for bit
            direct, offline = resumed[name + "@direct"][r], resumed[name][r]
            assert direct["losses"] == offline["losses"], (name, r)
            for k, v in offline["state_dict"].items():
                assert torch.equal(direct["state_dict"][k], v), (name, r, k)
        ref = harness.train_reference(name, m, steps=6, per_rank=GLOBAL_BATCH // m)
        losses = [sum(r["losses"][i] for r in resumed[name]) / m for i in range(3)]
        assert max(abs(x - y) for x, y in zip(losses, ref["losses"][3:])) <= 1e-5
        full = harness.consolidate(resumed[name])
        for k, v in ref["state_dict"].items():
            assert (full[k] - v).abs().max().item() <= 1e-5, k


@pytest.mark.xla
@pytest.mark.parametrize("m,sizes", [(4, (2, 1)), (2, (4,)), (1, (4,))])
def test_xla_loads_any_world_size_like_offline_resize(sources, m, sizes, tmp_path):
    """On m XLA:CPU devices, resuming from the N-rank files (gloo-written) resized while loading
    gives the same bits (losses, every shard after 3 more steps) as resuming from the offline resize."""
    names, prefixes = [], {}
    for n in sizes:
        for name in ["zero3_nested_adamw", "flatten_nested_adamw"]:
            offline = str(tmp_path / f"{name}_from{n}")
            assert resize_cli(["--ckpt_prefix", sources[n].format(name=name), "--world_size", str(m),
                                "--out_prefix", offline]) == 0
        prefixes[f"offline{n}"] = str(tmp_path / f"{{name}}_from{n}")
        prefixes[f"direct{n}"] = sources[n]
        names += [f"{name}@{kind}{n}" for name in ["zero3_nested_adamw", "flatten_nested_adamw"]
                  for kind in ("offline", "direct")]
    results = harness.run_xla(names, m, steps=3, start=3, per_rank=GLOBAL_BATCH // m, load_prefix=prefixes)
    for n in sizes:
        for name in ["zero3_nested_adamw", "flatten_nested_adamw"]:
            for r in range(m):
                direct, offline = results[f"{name}@direct{n}"][r], results[f"{name}@offline{n}"][r]
                assert direct["losses"] == offline["losses"], (name, n, r)
                for k, v in offline["state_dict"].items():
                    assert torch.equal(direct["state_dict"][k], v), (name, n, r, k)


def harness_rank(prefix, rank, ws):
    from xla_fsdp.checkpoints import rank_path
    return rank_path(prefix, rank, ws)


@pytest.mark.fast
def test_resume_is_bit_exact_and_full_checkpoint_resumes_too(tmp_path):
    """k steps + save + new processes + load + k steps == 2k uninterrupted steps, bit for bit (gloo);
    resuming from the consolidated full checkpoint (load_full_*) gives the same bits."""
    names = ["zero3_nested_adamw", "flatten_nested_adamw", "dim0_nested_sgd"]
    whole = harness.run_gloo(names, 2, steps=4)
    prefix = str(tmp_path / "{name}")
    harness.run_gloo(names, 2, steps=2, save_prefix=prefix)
    resumed = harness.run_gloo(names, 2, steps=2, start=2, load_prefix=prefix)
    for name in names:
        consolidate(prefix.format(name=name), "--optimizer")
    from_full = harness.run_gloo(names, 2, steps=2, start=2, load_full_path=prefix + "_full.pth")
    for name in names:
        for run in (resumed, from_full):
            for r in range(2):
                assert run[name][r]["losses"] == whole[name][r]["losses"][2:]
                for k, v in whole[name][r]["state_dict"].items():
                    assert torch.equal(run[name][r]["state_dict"][k], v), (name, k)


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    harness.copy_session_checkpoint("torch", 2, "zero3_nested_adamw", str(root / "a"))
    harness.copy_session_checkpoint("torch", 2, "zero3_nested_adamw", str(root / "b"), before_training=True)
    harness.copy_session_checkpoint("torch", 4, "zero3_nested_adamw", str(root / "c"))  # another size
    return root


def _bad_case(case, root, work):
    """Build a damaged copy of checkpoint 'a' in ``work``; returns (prefix, words the error must name)."""
    for f in os.listdir(root):
        shutil.copy(root / f, work / f)
    a0, a1 = work / "a_rank-00000000-of-00000002.pth", work / "a_rank-00000001-of-00000002.pth"
    if case == "missing_rank":
        os.unlink(a1)
        return str(work / "a"), ["missing", "a_rank-00000001-of-00000002.pth"]
    if case == "mixed_world_sizes":
        shutil.copy(work / "c_rank-00000003-of-00000004.pth", work / "a_rank-00000003-of-00000004.pth")
        return str(work / "a"), ["different world sizes", "a_rank-00000003-of-00000004.pth"]
    if case == "two_runs":
        shutil.copy(work / "b_rank-00000001-of-00000002.pth", a1)
        return str(work / "a"), ["different saves", "a_rank-00000001-of-00000002.pth"]
    if case == "duplicate_rank":
        shutil.copy(a0, a1)  # rank 0's data under rank 1's name
        return str(work / "a"), ["a_rank-00000001-of-00000002.pth", "rank 0"]
    if case == "flipped_byte":
        data = bytearray(open(a1, "rb").read())
        ckpt = torch.load(a1, weights_only=False)
        biggest = max(ckpt["model"].values(), key=lambda t: t.numel())
        needle = biggest.numpy().tobytes()[:16]
        at = bytes(data).find(needle)
        assert at > 0
        data[at + 5] ^= 0x01
        open(a1, "wb").write(bytes(data))
        return str(work / "a"), ["a_rank-00000001-of-00000002.pth"]
    if case == "no_match":
        return str(work / "zzz"), ["no rank files match", "zzz"]
    raise ValueError(case)


@pytest.mark.parametrize("case", ["missing_rank", "mixed_world_sizes", "two_runs", "duplicate_rank",
                                  "flipped_byte", "no_match"])
def test_bad_input_fails_clearly_and_touches_nothing(case, good_ckpt, tmp_path, capsys):
    prefix, words = _bad_case(case, good_ckpt, tmp_path)
    before = {f: _sha(tmp_path / f) for f in os.listdir(tmp_path)}
    for argv in (["--ckpt_prefix", prefix, "--verify"], ["--ckpt_prefix", prefix],
                 ["--ckpt_prefix", prefix, "--format", "safetensors"]):
        assert consolidate_cli(argv) != 0
        err = capsys.readouterr().err
        for w in words:
            assert w in err, (case, err)
    assert resize_cli(["--ckpt_prefix", prefix, "--world_size", "3", "--out_prefix", str(tmp_path / "out")]) != 0
    after = {f: _sha(tmp_path / f) for f in os.listdir(tmp_path) if f in before}
    assert before == after
    assert not any(f.startswith("out") or f.endswith(".tmp") for f in os.listdir(tmp_path))


def test_unwritable_output_and_default_suffix_never_rereads_output(good_ckpt, tmp_path, capsys):
    for f in os.listdir(good_ckpt):
        shutil.copy(good_ckpt / f, tmp_path / f)
    prefix = str(tmp_path / "a")
    (tmp_path / "a_file").write_text("")
    assert consolidate_cli(["--ckpt_prefix", prefix, "--save_path", str(tmp_path / "a_file" / "x.pth")]) != 0
    assert "'" + str(tmp_path / "a_file") + "' is a file, not a folder" in capsys.readouterr().err
    # torch_xla's default suffix '*.pth' re-read its own output; twice in a row must work here
    from xla_fsdp import consolidate_sharded_model_checkpoints
    first, path = consolidate_sharded_model_checkpoints(prefix)
    second, path2 = consolidate_sharded_model_checkpoints(prefix)
    assert path == path2 == prefix + "_consolidated.pth"
    assert_bit_exact(second, first)
    assert consolidate_cli(["--ckpt_prefix", prefix, "--verify"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_kill_during_save_never_leaves_a_bad_file(tmp_path, mode):
    """SIGKILL a saving process at random points (5 trials per mode): the file under the final name
    is always a complete checkpoint, the last one reported saved or a newer one, holding the values
    at its save (async: the parameters change while it is written), and no temp file is mistaken
    for a checkpoint."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from xla_fsdp.checkpoints import ShardedCheckpoint, rank_path

    prefix = str(tmp_path / "live")
    helper = os.path.join(os.path.dirname(__file__), "kill_saver.py")
    rng = random.Random(0 if mode == "blocking" else 1)
    # a killed saver cannot remove its temp files (its gloo file store, torch.distributed.nn's folder):
    # they go to a folder of the test's own, removed with tmp_path
    env = dict(os.environ, TMPDIR=str(tmp_path.parent / f"{tmp_path.name}-saver-tmp"))
    os.makedirs(env["TMPDIR"])
    for trial in range(5):
        proc = subprocess.Popen([sys.executable, helper, prefix] + (["--async"] if mode == "async" else []),
                                stdout=subprocess.PIPE, text=True, env=env)
        last = -1
        target = rng.randint(1, 3)
        while last < target:  # let it complete a few saves, then kill it mid-way through another
            line = proc.stdout.readline()
            assert line, "saver exited early"
            if line.startswith("saved "):
                last = int(line.split()[1])
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for line in proc.stdout.read().splitlines():
            if line.startswith("saved "):
                last = int(line.split()[1])
        ckpt = torch.load(rank_path(prefix, 0, 1), weights_only=False)  # never truncated
        saved = ckpt["extra"]["n"]
        assert saved >= last, (trial, saved, last)
        assert all(torch.all(t == float(saved)) for t in ckpt["model"].values() if t.is_floating_point())
        assert ShardedCheckpoint(prefix).verify()  # checksums match
        for f in os.listdir(tmp_path):  # leftovers of the killed write are temp files, never final names
            assert f == os.path.basename(rank_path(prefix, 0, 1)) or f.endswith(".tmp"), f


def _torch_xla_fsdp_checkpoint(prefix):
    """Train torch_xla's own XlaFullyShardedDataParallel one step and save it its documented way."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TorchXlaFSDP

    dev = torch_xla.device()
    torch.manual_seed(0)
    model = models.ConvBN()
    model.conv1 = TorchXlaFSDP(model.conv1, flatten_parameters=True)  # nested + flattened unit
    model = TorchXlaFSDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = models.batch("convbn", 0, 0)
    models.loss_fn("convbn", model(x.to(dev)), y.to(dev)).backward()
    opt.step()
    torch_xla.sync()
    ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(), "optimizer": opt.state_dict()}
    xm.save(ckpt, f"{prefix}_rank-{0:08d}-of-{1:08d}.pth", master_only=False)
    # the reference: torch_xla's own consolidation of the same files
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts
    full = consolidate_sharded_state_dicts([{k: v.cpu() for k, v in model.state_dict().items()}],
                                           model.get_shard_metadata())
    return {k: v.cpu().clone() for k, v in full.items()}


@pytest.mark.xla
def test_torch_xla_checkpoint_consolidates_and_resizes(tmp_path, monkeypatch):
    """A checkpoint written by torch_xla's XlaFSDP (PJRT_DEVICE=CPU, 1 device) goes through our CLIs."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    prefix = str(tmp_path / "txla")
    want = run_multiprocess(_torch_xla_fsdp_checkpoint, prefix)[0]
    got = consolidate(prefix)["model"]
    params = {k: v for k, v in want.items() if "running_" not in k and "num_batches" not in k}
    for k, v in params.items():
        assert torch.equal(got[k], v), k
    assert set(got) == {k for k, _ in models.ConvBN().state_dict().items()}
    assert consolidate_cli(["--ckpt_prefix", prefix, "--verify"]) == 0
    out = prefix + "_ws2"
    assert resize_cli(["--ckpt_prefix", prefix, "--world_size", "2", "--out_prefix", out]) == 0
    a, b = consolidate(prefix, "--optimizer"), consolidate(out, "--optimizer")
    assert_bit_exact(b["model"], a["model"])
    assert set(a["optimizer"]["state"]) == {n for n, _ in models.ConvBN().named_parameters()}
    for name, st in a["optimizer"]["state"].items():
        assert_bit_exact(b["optimizer"]["state"][name], st)


def test_the_clis_print_no_warning(sources, tmp_path):
    """Every CLI, run as a user runs it on a real checkpoint, writes nothing to stderr that warns: no
    warning of ours and none that our calls cause in torch (both environments run this: torch 2.9 and
    the newest release, where torch deprecated collectives and load defaults)."""
    prefix = sources[2].format(name="zero3_nested_adamw")
    out = str(tmp_path)
    commands = [
        ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", prefix, "--optimizer", "--save_path", f"{out}/a.pth"],
        ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", prefix, "--verify"],
        ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", prefix, "--format", "safetensors",
         "--max_shard_size", "1KB", "--save_path", f"{out}/hf"],
        ["xla_fsdp.resize", "--ckpt_prefix", prefix, "--world_size", "3", "--out_prefix", f"{out}/ws3"],
        ["xla_fsdp.inspect", "--ckpt_prefix", prefix],
        ["xla_fsdp.convert", "--to", "dcp", "--ckpt_prefix", prefix, "--out", f"{out}/dcp"],
        ["xla_fsdp.convert", "--from", "dcp", "--ckpt_dir", f"{out}/dcp", "--world_size", "2", "--out_prefix",
         f"{out}/back"],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "PYTHONWARNINGS")}
    for cmd in commands:
        proc = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True,
                              env=dict(env, PYTHONPATH=ROOT))
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
        assert "warn" not in proc.stderr.lower(), (cmd, proc.stderr[-2000:])


def _layers(big: bool, offset: float) -> torch.nn.Sequential:
    """``0``, ``2`` (and ``4`` when big): Linear layers with values set without a generator (XLA's
    rank threads share it), ``offset`` telling the two models' values apart."""
    layers = [torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6)]
    if big:
        layers += [torch.nn.ReLU(), torch.nn.Linear(6, 6)]
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1) / 7 + offset)
    return model


def _another_model_facts(me, folder, flatten):
    """Checkpoints of one model loaded into another (the small one lacks ``4.weight`` / ``4.bias``),
    strict and not, by ``load_sharded_checkpoint`` and ``resume_training``."""
    import xla_fsdp
    from xla_fsdp.checkpoints import full_state_dict
    from xla_fsdp.checkpoints.files import ModelMismatchError

    def wrap(big, offset):
        model = xla_fsdp.XlaFullyShardedDataParallel(_layers(big, offset).to(me.device), flatten_parameters=flatten)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(2, 6).to(me.device)).sum().backward()
        opt.step()
        me.sync()
        return model, opt

    def full(model):
        return full_state_dict(model, rank0_only=False)

    def refused(call):
        try:
            call()
        except ModelMismatchError as e:
            return str(e)
        return "loaded"

    facts = {}
    big, big_opt = wrap(True, 10.0)
    xla_fsdp.save_training_checkpoint(big, big_opt, os.path.join(folder, "big"), step=1)
    small, small_opt = wrap(False, 0.0)
    xla_fsdp.save_sharded_checkpoint(small, small_opt, os.path.join(folder, "small"))
    big_prefix = os.path.join(folder, "big", "step-000000001")
    small_before = full(small)
    before_files = sorted(os.listdir(os.path.join(folder, "big")))
    facts["resume_strict"] = refused(lambda: xla_fsdp.resume_training(small, small_opt, os.path.join(folder, "big")))
    facts["load_strict"] = refused(lambda: xla_fsdp.load_sharded_checkpoint(small, small_opt, big_prefix))
    facts["untouched"] = all(torch.equal(v, small_before[k]) for k, v in full(small).items())
    facts["files_kept"] = sorted(os.listdir(os.path.join(folder, "big"))) == before_files
    resumed = xla_fsdp.resume_training(small, small_opt, os.path.join(folder, "big"), strict=False)
    facts["resume_loose"] = (resumed.step, resumed.missing_keys, resumed.unexpected_keys)
    big_values = full(big)
    facts["loaded_shared"] = all(torch.equal(v, big_values[k]) for k, v in full(small).items())
    # the other way: the small model's checkpoint into the big one
    big_before = full(big)
    small_prefix = os.path.join(folder, "small")
    facts["into_big_strict"] = refused(lambda: xla_fsdp.load_sharded_checkpoint(big, None, small_prefix))
    loaded = xla_fsdp.load_sharded_checkpoint(big, None, os.path.join(folder, "small"), strict=False)
    facts["into_big_loose"] = (loaded.missing_keys, loaded.unexpected_keys)
    after = full(big)
    facts["missing_kept"] = all(torch.equal(after[k], big_before[k]) for k in ("4.weight", "4.bias"))
    facts["shared_loaded"] = all(torch.equal(after[k], small_before[k]) for k in small_before)
    facts["into_big_with_optimizer"] = refused(
        lambda: xla_fsdp.load_sharded_checkpoint(big, big_opt, os.path.join(folder, "small"), strict=False))
    return facts


@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_a_checkpoint_of_another_model_is_refused_naming_both_sides(transport, tmp_path):
    """Before: a checkpoint holding ``4.weight`` / ``4.bias`` loaded into a model
    without them (``load_sharded_checkpoint`` and ``resume_training``) and nobody was told. Now strict
    as ``load_state_dict``: one ``ModelMismatchError`` on every rank naming the names, nothing loaded
    and no checkpoint set aside as damaged; ``strict=False`` loads the names both have and returns the
    rest (the model's missing ones keep their values). 2 ranks, per-parameter and flattened."""
    from ranks import on_gloo, on_xla
    for flatten in (False, True):
        folder = tmp_path / f"flat{int(flatten)}"
        folder.mkdir()
        if transport == "torch":
            results = on_gloo(_another_model_facts, 2, str(folder), flatten)
        else:
            results = on_xla(_another_model_facts, 2, str(folder), flatten)
        for facts in results:
            for key in ("resume_strict", "load_strict"):
                assert "was saved from another model" in facts[key], facts[key]
                assert "it holds '4.weight', '4.bias' that the model has not (2 unexpected)" in facts[key], facts[key]
                assert "pass strict=False" in facts[key], facts[key]
            assert facts["untouched"] and facts["files_kept"], facts
            assert facts["resume_loose"] == (1, [], ["4.weight", "4.bias"]), facts
            assert facts["loaded_shared"], facts
            assert "the model's '4.weight', '4.bias' are not in it (2 missing)" in facts["into_big_strict"], facts
            assert facts["into_big_loose"] == (["4.weight", "4.bias"], []), facts
            assert facts["missing_kept"] and facts["shared_loaded"], facts
            if flatten:  # one flat entry holds 0, 2 and 4: its optimizer state cannot be split
                assert "holds only some parameters" in facts["into_big_with_optimizer"], facts
            else:  # 4.weight / 4.bias start afresh
                assert facts["into_big_with_optimizer"] == "loaded", facts


def _save_on_rank_0_only(me, folder, other):
    """Rank 0 saves; rank 1 does not (``other``: it waits in a barrier, or leaves)."""
    import warnings
    from datetime import timedelta

    import torch.distributed as dist
    import xla_fsdp
    import xla_fsdp.collectives.torch_dist as torch_dist
    from xla_fsdp.checkpoints import CheckpointError

    dist.distributed_c10d._get_default_store().set_timeout(timedelta(seconds=4))  # the job's timeout
    torch_dist.LATE_WARNING_S = 1.0
    model = xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4))
    if me.rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                xla_fsdp.save_sharded_checkpoint(model, None, os.path.join(folder, "ck"))
                outcome = "saved"
            except CheckpointError as e:
                outcome = str(e)
        return outcome, [str(w.message) for w in caught if "xla_fsdp" in str(w.message)], os.listdir(folder)
    if other == "barrier":
        try:
            dist.barrier()
        except RuntimeError as e:  # rank 0 left: gloo's error, after rank 0's
            return f"barrier: {type(e).__name__}"
    return other


@pytest.mark.parametrize("other", ["barrier", "left"])
def test_a_save_on_rank_0_only_is_named_not_aborted(other, tmp_path):
    """Before: ``save_sharded_checkpoint`` under ``if rank == 0:`` aborted rank 0
    on gloo's collective mismatch (``EnforceNotMet``, exit -6) when rank 1 waited in a barrier, or
    failed with "Connection reset" when it had left. Now rank 0 warns while it waits and then raises one
    error naming the rank and the fix, and no file is written."""
    from ranks import on_gloo
    (outcome, warned, files), peer = on_gloo(_save_on_rank_0_only, 2, str(tmp_path), other, errors_as_results=True)
    assert "save_sharded_checkpoint is called on every rank" in outcome, outcome
    assert "ranks [1] did not call it within the job's timeout (4 s)" in outcome and "`if rank == 0:`" in outcome
    assert len(warned) == 1 and "rank 0 has waited 1 s in save_sharded_checkpoint for ranks [1]" in warned[0], warned
    assert files == [], files
    assert peer == ("barrier: RuntimeError" if other == "barrier" else "left"), peer
