"""What a run reports: metrics rows (rank 0's JSON-lines file), the progress bar, the clock's notes, failed background
saves, the final summary row and the two lines a person reads at the end."""

import dataclasses
import json
import os
import queue
import threading
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from headloss import chunk_graphs
from plan import peak_flops
from streams import lost_log_streams


def summary_row(run, clock, state, val_loss, val_batches):
    """The final metrics row: what happened (state: train.Trainer), beside the plan; clock start, start-up and bad
    windows agreed over ranks."""
    first_clock = torch.tensor([state.clock_start_unix], device=run.device, dtype=torch.float64)
    startup = torch.tensor(
        [-1.0 if state.startup_s is None else state.startup_s], device=run.device, dtype=torch.float64
    )
    bad_windows = torch.tensor([run.loader.bad_windows], device=run.device)
    eager_runs = torch.tensor([run.eager_runs.count], device=run.device)
    if run.world > 1:
        dist.all_reduce(first_clock, op=dist.ReduceOp.MIN)
        dist.all_reduce(startup, op=dist.ReduceOp.MAX)
        dist.all_reduce(bad_windows)
        dist.all_reduce(eager_runs, op=dist.ReduceOp.MAX)
    return {
        "summary": True,
        "steps": state.step,
        "tokens": state.tokens,
        "train_s": round(state.train_s, 3),
        "tokens_per_s": round(state.tokens / max(state.train_s, 1e-9)),
        "compile_s": round(clock.compile_s, 3),
        "compiled_graphs": compiled_graphs() if run.hp.compile else 0,
        "planned_graphs": planned_graphs(run.raw_model, run.plan.micro_batch * run.hp.seq_len, run.device.type)
        if run.hp.compile
        else 0,
        "compile_fallback": state.compile_fallback,  # the first failing rank's reason
        "compile_fallback_ranks": state.compile_fallback_ranks,  # every rank that runs eagerly since step 0
        "attention": state.attention.name,  # the SDPA backend preferred (kernels.choose_attention)
        "attention_op": state.attention.op,  # the one torch picks under it for the training call: what step 0 compiled
        "eager_runs": eager_runs.item(),  # calls of compiled regions run eagerly after a guard miss (slower steps)
        "final_lr_frac": state.lr_frac,
        "stop_reason": state.stop_reason,
        "weights": state.weights,  # what the final checkpoint holds: plain, or the tail EMA's blend
        "val_loss": val_loss,
        "val_batches": val_batches,
        "params": run.raw_model.num_params(),
        "world_size": run.world,
        "budget_s": round(clock.budget_s, 3),
        "time_limit_min": run.hp.time_limit_min,
        "grad_accum_steps": clock.accum,
        "bad_windows": bad_windows.item(),
        "lost_streams": lost_log_streams(),
        "step0_saved_unix": run.checkpointer.written.get(0),  # rank 0's step-0 file in place (a background save)
        "clock_start_unix": first_clock.item(),
        "startup_s": round(startup.item(), 3) if startup.item() >= 0 else None,  # process start to clock start
        "plan": dataclasses.asdict(run.plan),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(run.device) / 2**30, 2)
        if run.device.type == "cuda"
        else None,
    }


def compiled_graphs():
    """Graphs torch.compile made in this process (dynamo's own count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def planned_graphs(model, micro_tokens, device_type):
    """The graphs a compiled run makes in training: one per kind of block (model.compile_per_block: with and without
    value embeddings), one per MUDD mix, and the head's loss math's (headloss.compiled_head_loss)."""
    blocks = len({k is None for k in model.ve_index}) + len(model.mudd if model.mudd is not None else ())
    return blocks + chunk_graphs(micro_tokens, model.padded_vocab, device_type)


class MetricsFile:
    """Rank 0's metrics rows, written and flushed by a thread of their own: put() only queues a line, so a file system
    that stalls (NFS) holds that thread, never the training loop and the ranks that wait for it. Rows are written in
    order. A write that fails (a full disk) ends the file: .error says why, and later rows are dropped."""

    def __init__(self, handle):
        self.handle, self.error, self.closed, self._said = handle, None, False, False
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, daemon=True)  # a stuck write never keeps the process
        self._thread.start()

    def put(self, row):
        self._lines.put(json.dumps(row) + "\n")

    def _drain(self):
        end = False
        while not end:
            lines = [self._lines.get()]  # then whatever else is queued: one write and one flush for all of them
            while not self._lines.empty():
                lines.append(self._lines.get())
            end = lines[-1] is None
            if self.error is None:
                try:
                    self.handle.write("".join(line for line in lines if line is not None))
                    self.handle.flush()
                except OSError as e:
                    self.error = e.strerror or str(e)

    def failure(self):
        """Why the file stopped taking rows, the first time this is asked after it did; else None."""
        if self.error is None or self._said:
            return None
        self._said = True
        return self.error

    def close(self, timeout):
        """Wait up to timeout seconds for the queued rows to be written, then close the file; False when the writer
        is still stuck then: it is abandoned (a daemon thread, gone with the process)."""
        if not self.closed:
            self.closed = True
            self._lines.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        try:
            self.handle.close()
        except OSError as e:  # the flush of rows a full disk refused
            self.error = self.error or e.strerror or str(e)
        return True


# at the end, the longest a stalled file system may hold the last metrics rows: the checkpoint is on disk by then, and
# under SLURM at most half of what is left of the job (the reserve after training is 60 s), so the ranks still exit;
# but at least a second, past the job's end too (SLURM kills 30 s after its signal): a healthy file takes the last rows
# in microseconds, and a join of 0 s would drop them whenever the writer thread had not yet been scheduled
METRICS_DRAIN_S = 30.0
METRICS_DRAIN_MIN_S = 1.0


def close_metrics(run):
    """Rank 0's metrics file, its queued rows written: at most METRICS_DRAIN_S, never past half the job's remaining
    time; a writer still stuck is said and left behind."""
    if run.metrics is None or run.metrics.closed:
        return
    job_left = run.deadline + run.hp.slurm_reserve_s - time.time()
    wait_s = max(min(METRICS_DRAIN_S, job_left / 2), METRICS_DRAIN_MIN_S)
    if not run.metrics.close(wait_s):
        run.say(
            f"warning: {run.hp.metrics_path} took no rows for {wait_s:.0f} s (a stalled file system?); "
            f"the last rows are dropped so that the run can exit"
        )
    elif why := run.metrics.failure():
        run.say(metrics_failure(run.hp.metrics_path, why))


def carry_rows(path, handle, up_to_step):
    """A resumed run's metrics start with the rows of the jobs before it, up to the step its state holds (a later row
    is of steps it trains again) and without their summary rows (its own counts every job)."""
    try:
        with open(path) as old:
            lines = old.read().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a job killed mid-write
            continue
        if isinstance(row, dict) and not row.get("summary") and row.get("step", 0) <= up_to_step:
            handle.write(line + "\n")


def metrics_failure(path, why):
    return f"warning: cannot write {path} ({why}); metrics rows stop here"


def process_age_s():
    """Seconds since this process started (Linux's /proc: field 22 of /proc/self/stat, in clock ticks after boot,
    against /proc/uptime), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return float(uptime.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class Logger:
    """Metrics rows (rank 0's file, through its writer thread), the progress bar, the clock's notes and failed
    background saves."""

    def __init__(self, run, clock):
        self.run, self.clock = run, clock
        self.peak = (run.hp.peak_tflops * 1e12 if run.hp.peak_tflops else peak_flops(run.device)) * run.world
        self.bar = tqdm(
            total=round(clock.budget_s), unit="s", disable=run.rank != 0, dynamic_ncols=True, mininterval=1.0
        )
        self.prev_tokens = 0

    def emit(self, row):
        """Queue the row (rank 0); a file that stopped taking rows (a full disk) is said once, and training goes on."""
        if self.run.metrics is None or self.run.metrics.closed:
            return
        self.run.metrics.put(row)
        if why := self.run.metrics.failure():
            self.run.say(metrics_failure(self.run.hp.metrics_path, why))

    def row(self, step, tokens, elapsed, lr_frac, train_loss):
        """The training row of a sync."""
        tok_s = (tokens - self.prev_tokens) / max(elapsed - self.clock.prev_elapsed, 1e-9)
        self.prev_tokens = tokens
        row = {
            "step": step,
            "elapsed_s": round(elapsed, 3),
            "lr_frac": lr_frac,
            "train_loss": train_loss,
            "tokens": tokens,
            "tokens_per_step": self.run.world * self.run.plan.micro_batch * self.run.hp.seq_len * self.clock.step_accum,
            "tokens_per_s": round(tok_s),
        }
        if self.peak:
            row["mfu"] = round(tok_s * self.run.plan.flops_per_token / self.peak, 4)
        self.emit(row)
        self.bar.set_postfix(
            step=step, loss=f"{train_loss:.3f}", lr=f"{lr_frac:.2f}", tok_s=f"{tok_s:.3g}", refresh=False
        )
        self.bar.update(min(round(elapsed), self.bar.total) - self.bar.n)

    def notes(self):
        for note in self.clock.notes:
            self.run.say(note)
        self.clock.notes.clear()

    def meta(self, step, tokens, weights="plain"):
        return {"config": self.run.config, "step": step, "tokens": tokens, "weights": weights}

    def failed_save(self, wait=True):
        """A background save that failed is said once; training goes on and the previous checkpoint stays."""
        error = self.run.checkpointer.wait() if wait else self.run.checkpointer.poll()
        if error:
            self.run.say(f"warning: a background checkpoint save failed ({error}); training goes on")

    def close(self, train_s):
        """The bar ends where training ended (all of it, on the clock), then closes; the metrics file too."""
        self.bar.update(min(round(train_s), self.bar.total) - self.bar.n)
        self.bar.close()
        close_metrics(self.run)


# --profile records these optimizer steps: after the compile step (0) and two steps of warm-up
PROFILE_FROM, PROFILE_STEPS = 3, 3
PROFILE_TOP_OPS = 15  # rows of the top-ops table said at the end of the window


def trace_path(metrics_path):
    """Where --profile writes its trace: beside the metrics file, named after it (metrics.trace.json)."""
    return os.path.splitext(metrics_path)[0] + ".trace.json"


class StepProfile:
    """--profile, on rank 0: torch.profiler (CPU, and CUDA on a GPU) over PROFILE_STEPS optimizer steps from
    PROFILE_FROM, each marked "step N"; then a Chrome trace beside the metrics (Perfetto and chrome://tracing open
    it) and the top ops by self time. The window is on the clock: each profiled step's time beyond the clock's
    forecast of it, and the export, are counted as paused (like a validation), so the step time the clock measures
    stays the unprofiled one. The loop calls begin and end around every step and close after the last; end and close
    return the seconds to count as paused."""

    def __init__(self, run, clock):
        self.run, self.clock, self.profiler, self.mark, self.done = run, clock, None, None, False
        self.path = trace_path(run.hp.metrics_path)

    def begin(self, step):
        if self.done or step < PROFILE_FROM:
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.run.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.first, self.started = step, time.perf_counter()
            self.profiler.__enter__()
        self.step_start = time.perf_counter()
        self.mark = torch.profiler.record_function(f"step {step}")
        self.mark.__enter__()

    def end(self, step):
        """After a step (step: the steps done): its time beyond the clock's forecast, and after the window's last
        step the trace's export (close)."""
        if self.mark is None:
            return 0.0
        self.mark.__exit__(None, None, None)
        self.mark = None
        if self.run.device.type == "cuda":  # the GPU's share of the window ends in it
            torch.cuda.synchronize(self.run.device)
        paused = max(time.perf_counter() - self.step_start - self.clock.step_s, 0.0)
        return paused + (self.close(step) if step - self.first >= PROFILE_STEPS else 0.0)

    def close(self, step):
        """The trace written and the top ops said (a run that ended inside the window: what it recorded); returns
        the export's seconds."""
        if self.profiler is None or self.done:
            return 0.0
        self.done, export_start = True, time.perf_counter()
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(self.path)
        sort = "self_device_time_total" if self.run.device.type == "cuda" else "self_cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort, row_limit=PROFILE_TOP_OPS)
        paused = time.perf_counter() - export_start
        self.run.say(
            f"profile: steps {self.first}-{step - 1} in {self.path} (open it in https://ui.perfetto.dev or "
            f"chrome://tracing); the export's {paused:.1f} s and the profiler's overhead are counted as paused\n{table}"
        )
        return paused


def human_summary(summary, hp):
    """The end of a run in two lines; the full summary row is the last line of the metrics file."""
    floor = " (the floor)" if summary["final_lr_frac"] <= hp.min_lr_frac else ""
    return (
        f"done: {summary['steps']:,} steps on {summary['world_size']} rank(s), {summary['tokens'] / 1e6:,.4g}M tokens "
        f"in {summary['train_s']:.1f} s ({summary['stop_reason']}), LR fraction {summary['final_lr_frac']:.3g} at "
        f"the end{floor}; val loss {summary['val_loss']:.4f} on {summary['val_batches']} batches\n"
        f"checkpoint: {hp.checkpoint_path} ({checkpoint_holds(summary)}); metrics, with the full summary row: "
        f"{hp.metrics_path}"
    )


def checkpoint_holds(summary):
    """What the checkpoint on disk holds, from the summary's labels of it."""
    if summary.get("weights_step") is None:
        return "none was written"
    kind = "plain weights" if str(summary["weights"]).startswith("plain") else "the weights blended with their tail EMA"
    return f"step {summary['weights_step']}, {kind}"
