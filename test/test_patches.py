"""Importing xla_fsdp changes nothing outside it; what it changes later is installed by the code that
needs it, listed by ``xla_fsdp.patches`` and undone by it. Each check runs in a
fresh Python process, so what other tests installed in this one cannot hide a change."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what a process looks like from outside xla_fsdp: every attribute the package has ever replaced
SNAPSHOT = textwrap.dedent("""
    import atexit, os, sys
    # exit handlers registered and not unregistered since (atexit keeps no count that unregister lowers)
    LIVE_EXIT_HANDLERS, _register, _unregister = set(), atexit.register, atexit.unregister
    atexit.register = lambda f, *a, **k: (LIVE_EXIT_HANDLERS.add(f), _register(f, *a, **k))[1]
    atexit.unregister = lambda f: (LIVE_EXIT_HANDLERS.discard(f), _unregister(f))[1]
    import torch, torch.distributed as dist, torch.optim.optimizer as topt
    from torch._weights_only_unpickler import _safe_globals
    TARGETS = [(dist, "init_process_group"), (dist, "get_rank"), (dist, "destroy_process_group"),
               (dist.distributed_c10d, "init_process_group"), (dist.distributed_c10d, "get_rank"),
               (dist.distributed_c10d, "destroy_process_group"), (_safe_globals, "__enter__"),
               (_safe_globals, "__exit__"), (dist.ProcessGroup, "rank")]
    try:
        import torch_xla, torch_xla.core.xla_model as xm, torch_xla._internal.pjrt as pjrt
        import torch_xla.distributed, torch_xla.experimental
        from torch_xla.distributed.xla_backend import ProcessGroupXla
        TARGETS += [(torch_xla, "sync"), (xm, "mark_step"), (xm, "all_gather"), (xm, "reduce_scatter"),
                    (xm, "all_reduce"), (xm, "rendezvous"), (xm, "save"), (xm, "_fetch_gradients"),
                    (pjrt, "run_multiprocess"), (pjrt, "_run_thread_per_device"), (pjrt._SpawnFn, "__call__"),
                    (torch_xla.distributed, "fsdp"), (torch_xla.experimental, "spmd_fully_sharded_data_parallel"),
                    (ProcessGroupXla, "broadcast")]
    except ImportError:
        pass

    def name(owner):
        return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__

    def snapshot():
        return {"attributes": {f"{name(o)}.{n}": id(getattr(o, n, None)) for o, n in TARGETS},
                "environ": dict(os.environ), "optimizer_hooks": len(topt._global_optimizer_pre_hooks),
                "meta_path": [id(f) for f in sys.meta_path],
                "exit_handlers": len(LIVE_EXIT_HANDLERS),
                "torch_xla_modules": sorted(k for k in sys.modules if k.startswith("torch_xla.distributed.fsdp"))}

    def changed(before, after):
        out = [k for k in before["attributes"] if before["attributes"][k] != after["attributes"][k]]
        out += ["$" + k for k in set(before["environ"]) | set(after["environ"])
                if before["environ"].get(k) != after["environ"].get(k)]
        out += [k for k in ("optimizer_hooks", "meta_path", "torch_xla_modules", "exit_handlers")
                if before[k] != after[k]]
        return sorted(out)
""")


def _run(folder, code: str, **env: str) -> dict:
    """Run ``code`` as a script of its own (spawned device processes import its functions)."""
    script = folder / "program.py"
    script.write_text(SNAPSHOT + textwrap.dedent(code))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, _failure(proc.stderr)
    return json.loads(lines[-1][len("RESULT "):])


def _failure(stderr: str) -> str:
    """What a failed run said: a process that died by a signal first (faulthandler's header and the
    stacks of the thread that crashed and its peers, which PYTHONFAULTHANDLER prints ahead of a long
    list of extension modules), then the end."""
    fatal = stderr.find("Fatal Python error")
    head = stderr[fatal:fatal + 6000] + "\n...\n" if fatal >= 0 else ""
    return head + stderr[-2000:]


@pytest.mark.fast
@pytest.mark.parametrize("pjrt_device", ["CPU", None])
def test_importing_the_package_changes_nothing_outside_it(pjrt_device, tmp_path):
    """Before: with PJRT_DEVICE=CPU, 13 attributes of torch, torch.distributed and torch_xla were
    replaced for good by ``import xla_fsdp``, and two environment variables set."""
    env = {"PJRT_DEVICE": pjrt_device} if pjrt_device else {}
    result = _run(tmp_path, """
        import json
        before = snapshot()
        import xla_fsdp, xla_fsdp.checkpoints, xla_fsdp.cli.consolidate, xla_fsdp.cli.resize, xla_fsdp.cli.convert
        import xla_fsdp.cli.inspect, xla_fsdp.compat, xla_fsdp.spmd, xla_fsdp.integrations, xla_fsdp.wrap
        print("RESULT " + json.dumps({"changed": changed(before, snapshot()),
                                      "installed": [p.target for p in xla_fsdp.patches.installed()]}))
    """, **env)
    assert result == {"changed": [], "installed": []}


@pytest.mark.xla
def test_enabling_xla_cpu_devices_is_listed_and_undone(tmp_path):
    """``enable_xla_cpu_devices`` changes exactly what ``patches.installed()`` lists (with a reason
    for each), and ``patches.uninstall()`` leaves the process as it was, environment included."""
    result = _run(tmp_path, """
        import json
        import xla_fsdp
        before = snapshot()
        enabled = xla_fsdp.enable_xla_cpu_devices()
        again = xla_fsdp.enable_xla_cpu_devices()  # idempotent: nothing twice
        during = changed(before, snapshot())
        listed = [(p.target, p.reason) for p in xla_fsdp.patches.installed()]
        xla_fsdp.patches.uninstall()
        print("RESULT " + json.dumps({"enabled": enabled and again, "during": during, "listed": listed,
                                      "after": changed(before, snapshot()),
                                      "installed_after": len(xla_fsdp.patches.installed())}))
    """, PJRT_DEVICE="CPU")
    assert result["enabled"]
    listed = [target for target, _ in result["listed"]]
    assert len(listed) == len(set(listed)) == 21 and all(reason for _, reason in result["listed"])
    assert set(result["during"]) == set(listed)
    assert result["after"] == [] and result["installed_after"] == 0


def test_enabling_xla_cpu_devices_off_cpu_does_nothing(tmp_path):
    """TPUs (and processes without PJRT_DEVICE=CPU) need none of it."""
    result = _run(tmp_path, """
        import json
        import xla_fsdp
        before = snapshot()
        enabled = xla_fsdp.enable_xla_cpu_devices()
        print("RESULT " + json.dumps({"enabled": enabled, "changed": changed(before, snapshot())}))
    """, PJRT_DEVICE="TPU")
    assert result == {"enabled": False, "changed": []}


def test_what_units_install_is_listed_and_undone(tmp_path):
    """The first unit registers one optimizer step pre-hook (an optimizer built before wrapping is
    refused); it is listed, not repeated by later units, and removed by ``uninstall``."""
    result = _run(tmp_path, """
        import json
        import torch, torch.distributed as dist
        import xla_fsdp
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        before = snapshot()
        first = xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4))
        second = xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4))
        during = changed(before, snapshot())
        listed = [p.target for p in xla_fsdp.patches.installed()]
        xla_fsdp.patches.uninstall()
        after = changed(before, snapshot())
        dist.destroy_process_group()
        print("RESULT " + json.dumps({"during": during, "listed": listed, "after": after}))
    """)
    assert result["during"] == ["exit_handlers", "optimizer_hooks"]
    assert result["listed"] == ["atexit: xla_fsdp waits for torch.distributed's collectives",
                                "hook: torch.optim optimizer step pre-hook (xla_fsdp optimizer check)"]
    assert result["after"] == []


@pytest.mark.xla
def test_the_per_instance_linear_forward_on_xla_is_listed_and_undone(tmp_path):
    """On XLA a unit gives each plain nn.Linear it takes a forward that saves the weight for backward:
    listed once however many units and layers, and put back for every such layer by ``uninstall``
    (before: outside the registry, neither listed nor undone)."""
    result = _run(tmp_path, """
        import json
        import torch
        import xla_fsdp
        layers = [torch.nn.Linear(4, 4) for _ in range(3)]
        first = xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Sequential(*layers[:2]))
        second = xla_fsdp.XlaFullyShardedDataParallel(layers[2])
        patched = ["forward" in layer.__dict__ for layer in layers]
        listed = [p.target for p in xla_fsdp.patches.installed() if "Linear" in p.target]
        xla_fsdp.patches.uninstall()
        print("RESULT " + json.dumps({"patched": patched, "listed": listed,
                                      "after": ["forward" in layer.__dict__ for layer in layers]}))
    """, PJRT_DEVICE="CPU")
    assert result["patched"] == [True] * 3
    assert result["listed"] == ["instances: torch.nn.Linear.forward (xla_fsdp saves the weight, not its transpose)"]
    assert result["after"] == [False] * 3


@pytest.mark.fast
@pytest.mark.xla
def test_launch_enables_the_device_process_and_leaves_the_launcher_as_found(tmp_path):
    """``xla_fsdp.launch`` on 2 XLA:CPU devices: the device process has the XLA:CPU changes (the
    ranks train a unit and meet in ``xm.all_reduce``); the launching process is as before once it
    returns."""
    out = tmp_path / "ranks"
    out.mkdir()
    result = _run(tmp_path, f"""
        import json
        import xla_fsdp

        def rank(index, folder):
            import torch, torch_xla, torch_xla.core.xla_model as xm
            model = xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4).to(torch_xla.device()),
                                                         sync_module_states=True)  # the threads share one generator
            model(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
            total = xm.all_reduce("sum", torch.tensor([float(index + 1)]).to(torch_xla.device())).item()
            with open(f"{{folder}}/{{index}}.json", "w") as f:
                json.dump({{"total": total, "installed": len(xla_fsdp.patches.installed())}}, f)

        if __name__ == "__main__":
            before = snapshot()
            xla_fsdp.launch(rank, args=({str(out)!r},))
            print("RESULT " + json.dumps({{"changed": changed(before, snapshot())}}))
    """, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    assert result == {"changed": []}
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert [r["total"] for r in ranks] == [3.0, 3.0]
    assert all(r["installed"] >= 18 for r in ranks), ranks


@pytest.mark.xla
def test_units_on_xla_cpu_device_threads_without_the_launcher_say_what_to_call(tmp_path):
    """torch_xla.launch alone (no ``enable_xla_cpu_devices``): every rank gets one error naming the
    two fixes, before any collective could hang."""
    result = _run(tmp_path, """
        import json
        import torch
        import xla_fsdp
        from torch_xla._internal import pjrt

        def rank():
            import torch_xla
            try:
                xla_fsdp.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4).to(torch_xla.device()))
            except RuntimeError as e:
                return str(e)
            return "built"

        if __name__ == "__main__":
            print("RESULT " + json.dumps(list(pjrt.run_multiprocess(rank).values())))
    """, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    assert len(result) == 2
    for message in result:
        assert "xla_fsdp.launch(fn, args)" in message and "xla_fsdp.enable_xla_cpu_devices()" in message, message


@pytest.mark.fast
def test_a_change_to_a_module_imported_later_is_applied_after_its_code_listed_and_undone(tmp_path):
    """``patches.after_import``: for a module the program imports later (the HF Trainer under
    ``python -m xla_fsdp.compat``), the change is applied right after the module's own code ran, once,
    and listed; ``uninstall`` takes the finder out and undoes what the change listed."""
    (tmp_path / "later_module.py").write_text("VALUE = 'its own'\n")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from xla_fsdp import patches
        seen = []
        def apply(module):
            seen.append(module.VALUE)
            patches.replace(module, "VALUE", "changed", "a test change")
        patches.after_import("later_module", apply, "a test")
        finders = len(sys.meta_path)
        import later_module
        out = dict(seen=seen, value=later_module.VALUE, listed=[p.target for p in patches.installed()],
                   source=later_module.__loader__.get_source("later_module"))
        patches.uninstall()
        out.update(after=later_module.VALUE, finders_removed=finders - len(sys.meta_path),
                   again=patches.after_import("later_module", apply, "a test"), seen_again=seen)
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["value"] == "changed" and out["after"] == "its own", out
    assert out["listed"] == ["after import: later_module", "later_module.VALUE"], out
    assert out["source"] == "VALUE = 'its own'\n" and out["finders_removed"] == 1, out
    # listed again after uninstall: the module is imported now, so the change applies at once
    assert out["again"] is True and out["seen_again"] == ["its own", "its own"], out
