"""Start-up off the clock: the model built where it trains, the step-0 checkpoint written in the background (after a
check that the disk can take it), and whatever way the run then ends, that file on disk; the summary's startup_s."""

import torch

import checkpoint
import config
import kernels
import launch
from conftest import TINY, patched_train, read_metrics
from eval import load_checkpoint
from model import get_model
from synthetic import SYNTH_STATES


def test_the_model_is_built_where_it_trains_and_on_cpu_as_before(monkeypatch):
    """Made on its device, not made on the CPU and copied (529M parameters at the event); the meta device stands in
    for a GPU. On the CPU the weights are bit for bit those of get_model under the same seed (the two-rank tests
    lean on this)."""
    hp = config.resolve(config.Hyperparameters(n_layer=2, n_head=2, n_embd=64, seq_len=32, seed=3), 1)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64}
    plan = type("Plan", (), shape)  # build_model reads the plan's shape only
    made_on = []
    real = launch.get_model
    monkeypatch.setattr(launch, "get_model", lambda cfg: (made_on.append(torch.empty(0).device), real(cfg))[1])
    on_meta = launch.build_model(hp, plan, {}, torch.device("meta"), 1, kernels.EagerRuns(print, False))[0]
    assert made_on == [torch.device("meta")] and on_meta.wte.weight.is_meta
    on_cpu = launch.build_model(hp, plan, {}, torch.device("cpu"), 1, kernels.EagerRuns(print, False))[0]
    torch.manual_seed(3)
    reference = real({"vocab_size": hp.vocab_size, "seq_len": 32, **shape})
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in on_cpu.state_dict().items())


SLOW_STEP0 = (  # the step-0 file takes 4 s to write (NFS at the event); later saves as they are
    "real = checkpoint.save_checkpoint; "
    "checkpoint.save_checkpoint = lambda state, path: (time.sleep(4) if state['step'] == 0 else None, "
    "real(state, path))[1]"
)


def test_the_step0_save_runs_beside_the_clock_and_is_on_disk_however_the_run_ends(tmp_path):
    args = [*TINY, "--max_steps", "3", "--time_limit_min", "10", "--save_every_min", "0"]
    proc, started = patched_train(tmp_path, SLOW_STEP0, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["step0_saved_unix"] > summary["clock_start_unix"]  # training did not wait for the write
    assert summary["steps"] == 3 and load_checkpoint(tmp_path / "checkpoint.pt")[1]["step"] == 3
    # seconds from this process's start to the clock: all of the pre-clock work, imports included
    assert 0.5 * (summary["clock_start_unix"] - started) < summary["startup_s"]
    assert summary["startup_s"] <= summary["clock_start_unix"] - started + 0.1

    crashed = tmp_path / "crashed"  # the loop fails at once, with the step-0 write still under way
    crashed.mkdir()
    crash = f"{SLOW_STEP0}; train.Trainer.train = lambda trainer: 1 / 0"
    proc, _ = patched_train(crashed, crash, args)
    assert proc.returncode == 1 and "ZeroDivisionError" in proc.stderr
    model, ckpt = load_checkpoint(crashed / "checkpoint.pt")
    assert ckpt["step"] == 0 and not list(crashed.glob("*.tmp"))


def test_a_disk_with_room_for_one_checkpoint_but_not_two_is_refused_before_anything_is_written(tmp_path):
    """Every save writes a whole file beside the one it replaces before renaming it over (the step-0 file, then the
    final one beside it): a disk with room for one and a half checkpoints (by shutil.disk_usage) is refused before the
    clock, in one sentence that says what the saves need, and the folders on the way are not left behind either."""
    shape = {"vocab_size": SYNTH_STATES, "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
    size = 4 * get_model(shape).num_params() + checkpoint.SAVE_OVERHEAD
    free = f"shutil._ntuple_diskusage(2**40, 2**40, {int(1.5 * size)})"
    full = f"import shutil; checkpoint.shutil.disk_usage = lambda folder: {free}"
    args = [*TINY, "--max_steps", "2", "--checkpoint_path", "runs/a/checkpoint.pt"]
    proc, _ = patched_train(tmp_path, full, args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    mib = size / 2**20
    assert (
        f"--checkpoint_path runs/a/checkpoint.pt: each save writes a whole {mib:,.1f} MiB checkpoint beside the one it "
        f"replaces, so the run needs {2 * mib:,.1f} MiB free in {tmp_path / 'runs' / 'a'}, and it has {1.5 * mib:,.1f} "
        f"MiB" in proc.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoint, no metrics file, no folder


def test_a_failed_step0_save_is_said_once_and_training_goes_on(tmp_path):
    """The step-0 save fails in the background (the disk filled after the check, NFS went away): one warning, as for
    any background save, and the run trains and saves at the end."""
    failing = (
        "real = checkpoint.save_checkpoint\n"
        "def save(state, path):\n"
        "    if state['step'] == 0: raise checkpoint.CheckpointError('could not save it (No space left on device)')\n"
        "    real(state, path)\n"
        "checkpoint.save_checkpoint = save"
    )
    proc, _ = patched_train(tmp_path, failing, [*TINY, "--max_steps", "4", "--save_every_min", "0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "background checkpoint save failed" in line]
    assert said == [
        "warning: a background checkpoint save failed (could not save it (No space left on device)); training goes on"
    ]
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 4 and summary["step0_saved_unix"] is None
    assert load_checkpoint(tmp_path / "checkpoint.pt")[1]["step"] == 4
