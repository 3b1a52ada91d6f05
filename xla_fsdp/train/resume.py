"""Where a run_clm job goes on from and how it stops for a signal: the checkpoint it resumes (--resume_from_checkpoint,
or the newest complete one in --output_dir: Hugging Face's semantics), its saves (`Saves`), and the exit after the save
a SIGTERM asked for ([Note: a signal becomes a checkpoint] in xla_fsdp/checkpoint/preemption.py)."""
from __future__ import annotations


def resume(model, optimizer, scheduler, args, log) -> int:
    """Load --resume_from_checkpoint (a path, or 'auto': the newest complete one in --output_dir); returns the step to
    continue from (0: a fresh start)."""
    from xla_fsdp.checkpoint import latest_checkpoint, load_checkpoint

    path = args.resume_from_checkpoint
    if path is None:
        return 0
    if path == "auto":
        path = latest_checkpoint(args.output_dir)
        if path is None:
            log(f"run_clm: --resume_from_checkpoint auto: no complete checkpoint in {args.output_dir}; starting fresh")
            return 0
    got = load_checkpoint(path, model, optimizer, extra_state={"scheduler": scheduler})
    step = int(got["extra"]["data_position"])
    log(f"run_clm: resumed from {path} at step {step}")
    return step


def exit_preempted(preempted: dict, log) -> None:
    """After the save a signal asked for: say where and how to go on, and exit EXIT_PREEMPTED."""
    from xla_fsdp.checkpoint.preemption import EXIT_PREEMPTED

    where = f"run_clm: stopped by {preempted['signal']} signal at step {preempted['step']}"
    if preempted["checkpoint"] is None:
        log(f"{where}, before this run's first step ended or right after it: nothing saved; run the same command "
            f"again (exit status {EXIT_PREEMPTED})")
    else:
        log(f"{where}: checkpoint {preempted['checkpoint']} is complete; run the same command again (without "
            f"--overwrite_output_dir) to resume from it; exit status {EXIT_PREEMPTED}")
    raise SystemExit(EXIT_PREEMPTED)


class Saves:
    """run_clm's checkpoints: the manager opened at the first save (a job that saves nothing never opens --output_dir),
    written beside training unless --save_async false ([Note: saves beside training] in xla_fsdp/checkpoint/save.py)."""

    def __init__(self, args, model, optimizer, scheduler):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.manager = None
        self.step = None  # of the last save

    def save(self, step: int) -> None:
        from xla_fsdp.checkpoint import CheckpointManager

        if step == self.step:  # a signal at the step a periodic save took: that save is the one to resume
            return
        self.step = step
        if self.manager is None:
            self.manager = CheckpointManager(self.args.output_dir, keep_last=self.args.save_total_limit,
                                             async_save=self.args.save_async)
        self.manager.save(step, self.model, self.optimizer,
                          extra_state={"scheduler": self.scheduler, "data_position": step})

    def poll(self) -> None:
        if self.manager is not None:
            self.manager.poll()

    def wait(self) -> None:
        if self.manager is not None:
            self.manager.wait()
