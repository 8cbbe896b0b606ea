"""The first GRPO update, grpolab against TRL 1.16's GRPOTrainer, on identical rollouts (prints the
per-quantity differences; not a test). Run it in the benchmark venv: ``.venv-bench/bin/python
benchmarks/first_update.py`` (``make .venv-bench/.grpolab-installed`` builds it).

Why: ``make bench-tta`` (benchmarks/real_tta.py) compares time to accuracy, and on the AVX2 CPU TRL
learned more per sample on arithmetic. The two updates are meant to be the same algorithm; this
checks it step by step. Both sides start from the same SmolLM2-135M-Instruct and train on the *same*
32 sampled completions: grpolab samples its first rollout batch as real_tta.py configures it (the
task's config in configs/real/, its seed), and TRL's ``model.generate`` is replaced by one that
returns those exact token ids for each prompt (padded as Hugging Face's generate pads a finished
row), so TRL's reward, advantages, completion mask, loss and optimizer step run on what grpolab
trained on. TRL is configured exactly as real_tta.py's ``trl_worker`` configures it.

Printed, per side and their difference: the rewards and advantages (per prompt, sorted), the tokens
in the loss, the learning rate of the step, the optimizer's settings (betas, eps, weight decay per
parameter group), the loss, the gradient norm before clipping, the gradient (relative difference and
cosine, float64 sums), and the weights after the one optimizer step (the update's relative difference,
cosine, the largest weight difference and the share of elements whose step has another sign). The
two losses are different surrogates of one gradient (grpolab's -A log pi per token, TRL's -A pi/pi_old,
which is -A at ratio 1), so their values are shown, not expected equal. A seed whose first batch has
every advantage 0 moves neither side and is reported as such. One seed per process keeps its peak
resident memory at ~5.5 GB (``--seeds 1``, then ``--seeds 2``, ...; three seeds in one process, before a
seed's arrays were freed after it, reached 7.9 GB and were killed on a shared 24 GiB host).

Forcing torch onto its AVX2 kernels (the AVX2 machine's ISA) on an AVX-512 CPU:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``; the first line names the capability in force.

Usage: python benchmarks/first_update.py [--task arithmetic] [--seeds 0,1,2] [--dtype auto] [--threads 2]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def tta_module():
    spec = importlib.util.spec_from_file_location("bench_real_tta", ROOT / "benchmarks" / "real_tta.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GradCapture:
    """Wraps ``torch.nn.utils.clip_grad_norm_`` (both sides clip through it): the flat gradient and its
    norm before clipping."""

    def __init__(self):
        self.grad = self.norm = None
        self.original = torch.nn.utils.clip_grad_norm_

    def __call__(self, parameters, max_norm, *a, **kw):
        parameters = list(parameters)
        self.grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                               for p in parameters])
        self.norm = float(self.original(parameters, max_norm, *a, **kw))
        return torch.tensor(self.norm)

    def __enter__(self):
        torch.nn.utils.clip_grad_norm_ = self
        return self

    def __exit__(self, *exc):
        torch.nn.utils.clip_grad_norm_ = self.original


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def optimizer_settings(optimizer) -> list[dict]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
             if k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")} | {"n_params": len(g["params"])}
            for g in optimizer.param_groups]


def grpolab_side(args, tta) -> dict:
    """One grpolab GRPO step as real_tta.py's grpolab worker runs it; the rollouts, advantages,
    gradient and weights captured."""
    import grpolab.algorithms.grpo as grpo_mod
    from grpolab.algorithms.grpo import train_grpo

    out: dict = {}
    make_batch, update, make_opt = grpo_mod.make_rollout_batch, grpo_mod.policy_update, grpo_mod.make_optimizer

    def capture_batch(rollouts, rewards, advantages, pad_id):
        batch = make_batch(rollouts, rewards, advantages, pad_id)
        if "rollouts" not in out:
            out.update(rollouts=list(rollouts), rewards=rewards.tolist(), advantages=advantages.tolist(),
                       tokens=int(batch.response_mask.sum()))
        return batch

    def capture_update(run, batch, cfg, optimizer, *a, **kw):
        out.setdefault("lr", float(optimizer.param_groups[0]["lr"]))
        result = update(run, batch, cfg, optimizer, *a, **kw)
        out.setdefault("weights", flat(run.model))
        return result

    def capture_optimizer(*a, **kw):
        optimizer = make_opt(*a, **kw)
        out["optimizer"] = optimizer_settings(optimizer)
        return optimizer

    grpo_mod.make_rollout_batch, grpo_mod.policy_update, grpo_mod.make_optimizer = \
        capture_batch, capture_update, capture_optimizer
    args.samples = 32
    try:
        with tempfile.TemporaryDirectory() as tmp, GradCapture() as grads:
            cfg = tta.task_config(args, args.task, args.seed, str(Path(tmp) / "run"))
            out["dtype"] = cfg.dtype
            train_grpo(cfg, overwrite=True)
            records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        grpo_mod.make_rollout_batch, grpo_mod.policy_update, grpo_mod.make_optimizer = make_batch, update, make_opt
    step = next(r for r in records if "train/loss" in r)
    out.update(loss=step["train/loss"], grad_norm=grads.norm, grad=grads.grad, cfg=cfg,
               logged_grad_norm=step.get("train/grad_norm"), rows_trained=step.get("train/rows_trained"))
    return out


def trl_side(args, tta, g: dict) -> dict:
    """TRL's GRPOTrainer, configured as real_tta.py's trl_worker, for one step on grpolab's rollouts."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    cfg = g["cfg"]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dtype = args.dtype
    rollouts = g["rollouts"]
    prompts = [r.prompt for r in rollouts[:: cfg.group_size]]  # a group's rows are together; a question may repeat
    queue = {tok.decode(r.prompt_ids): [] for r in rollouts}
    for r in rollouts:
        queue[tok.decode(r.prompt_ids)].append(list(r.response_ids))
    by_text = {(r.prompt, r.response): reward for r, reward in zip(rollouts, g["rewards"])}
    tta.end_at_newline(model, tok)
    pad = model.generation_config.pad_token_id
    pad = tok.pad_token_id if pad is None else pad
    seen: dict = {"completions": [], "rewards": []}

    def generate(input_ids=None, attention_mask=None, **kw):  # grpolab's sampled ids, as HF's generate returns them
        rows = [queue[tok.decode(ids[m.bool()])].pop(0) for ids, m in zip(input_ids, attention_mask)]
        width = max(len(r) for r in rows)
        completions = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=input_ids.dtype)
        return torch.cat([input_ids, completions], dim=1)

    model.generate = generate

    def reward(prompts, completions, **kwargs):
        seen["completions"] += list(completions)
        found = []
        for p, c in zip(prompts, completions):
            matches = [v for (rp, rc), v in by_text.items() if rp == p and rc.strip() == c.strip()]
            if not matches:
                raise SystemExit(f"first_update.py: TRL's completion {c!r} is none of grpolab's for its prompt")
            found.append(matches[0])
        seen["rewards"] += found
        return found

    captured: dict = {}

    class Capturing(GRPOTrainer):
        def _clip_grad_norm(self, model):  # Trainer's clipping (through accelerate, not torch's function by name)
            params = [p for p in model.parameters() if p.requires_grad]
            captured["grad"] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
                                          .flatten() for p in params])
            norm = super()._clip_grad_norm(model)
            captured["grad_norm"] = float(norm)
            return norm

        def compute_loss(self, model, inputs, *a, **kw):
            captured.setdefault("advantages", []).extend(inputs["advantages"].flatten().tolist())
            captured.setdefault("tokens", 0)
            captured["tokens"] += int(inputs["completion_mask"].sum())
            captured.setdefault("prompt_ids", []).extend(
                tok.decode(p[m.bool()]) for p, m in zip(inputs["prompt_ids"], inputs["prompt_mask"]))
            return super().compute_loss(model, inputs, *a, **kw)

    data = Dataset.from_dict({"prompt": prompts})
    with tempfile.TemporaryDirectory() as out_dir:
        trl_cfg = tta.trl_config(cfg, args.seed, dtype, out_dir, max_steps=1)
        trainer = Capturing(model=model, reward_funcs=[reward], args=trl_cfg, train_dataset=data,
                            processing_class=tok)
        trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    settings = {k: getattr(trl_cfg, k) for k in ("adam_epsilon", "optim", "lr_scheduler_type", "warmup_steps",
                                                 "warmup_ratio", "epsilon", "epsilon_high", "delta", "top_k",
                                                 "repetition_penalty", "mask_truncated_completions",
                                                 "importance_sampling_level", "loss_type", "scale_rewards")
                if hasattr(trl_cfg, k)}
    return {"rewards": seen["rewards"], "advantages": captured["advantages"],
            "tokens": captured["tokens"], "loss": log["loss"], "grad_norm": captured.get("grad_norm"),
            "logged_grad_norm": log.get("grad_norm"), "lr": log.get("learning_rate"), "grad": captured.get("grad"),
            "weights": flat(trainer.model), "optimizer": optimizer_settings(trainer.optimizer), "dtype": dtype,
            "settings": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                         for k, v in settings.items()}, "pad_id": pad, "eos_id": tok.eos_token_id}


def dots(pairs: dict, chunk: int = 1 << 22) -> dict:
    """Dot products of flat float32 vectors, accumulated in float64 chunk by chunk (a float32 sum over
    135M elements loses the digits a cosine near 1 needs): ``pairs`` name -> (a, b)."""
    out = {}
    for name, (a, b) in pairs.items():
        out[name] = sum(float(torch.dot(a[i : i + chunk].double(), b[i : i + chunk].double()))
                        for i in range(0, a.numel(), chunk))
    return out


def closeness(a: torch.Tensor, b: torch.Tensor) -> dict:
    """|a - b| / |b| and the cosine of a and b, in float64."""
    d = dots({"aa": (a, a), "bb": (b, b), "ab": (a, b)})
    diff2 = max(0.0, d["aa"] + d["bb"] - 2 * d["ab"])
    return {"relative_diff": diff2 ** 0.5 / d["bb"] ** 0.5 if d["bb"] else None,
            "cosine": d["ab"] / (d["aa"] * d["bb"]) ** 0.5 if d["aa"] and d["bb"] else None,
            "norm_grpolab": d["aa"] ** 0.5, "norm_trl": d["bb"] ** 0.5}


def compare(start: torch.Tensor, g: dict, t: dict) -> dict:
    for side in (g, t):  # no clipping call (no step): a zero gradient
        side["grad"] = torch.zeros_like(start) if side["grad"] is None else side["grad"]
        side["grad_norm"] = side["grad_norm"] or 0.0
    dg, dt = g["weights"] - start, t["weights"] - start
    moved = (dg != 0) | (dt != 0)
    update = closeness(dg, dt)
    update.update(max_weight_diff=float((g["weights"] - t["weights"]).abs().max()),
                  sign_mismatch_share=float(((dg.sign() != dt.sign()) & moved).sum() / max(1, int(moved.sum()))))
    return {
        "loss": {"grpolab": g["loss"], "trl": t["loss"], "diff": g["loss"] - t["loss"]},
        "grad_norm_before_clip": {"grpolab": g["grad_norm"], "trl": t["grad_norm"],
                                  "ratio": g["grad_norm"] / t["grad_norm"] if t["grad_norm"] else None,
                                  "trl_logged": t["logged_grad_norm"], "grpolab_logged": g["logged_grad_norm"]},
        "grad": closeness(g["grad"], t["grad"]),
        "update": update,
        "lr": {"grpolab": g["lr"], "trl": t["lr"]},
        "tokens_in_loss": {"grpolab": g["tokens"], "trl": t["tokens"]},
        "rows_trained_grpolab": g["rows_trained"],
    }


def main() -> None:
    tta = tta_module()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arithmetic", help=f"of {', '.join(tta.CONFIGS)}")
    ap.add_argument("--seeds", default="0,1,2", help="each seed's first update is compared (a seed whose first "
                    "batch has every advantage 0 is reported as such: it moves nothing on either side)")
    ap.add_argument("--dtype", default="auto", help="auto (grpolab's probe, for both sides), float32 or bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct cache (make real-model)")
    args = ap.parse_args()
    args.model = args.model or tta.step_benchmark().default_model()
    torch.set_num_threads(args.threads)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch CPU capability: {capability} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')}, "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}); task {args.task}",
          flush=True)
    from transformers import AutoModelForCausalLM

    from grpolab.training.resources import choose_dtype, model_shape

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    args.dtype, line = choose_dtype(args.dtype, "cpu", model_shape(model))  # decided once, for both sides
    if line:
        print(line, flush=True)
    start = flat(model)
    del model
    results = []
    for seed in [int(x) for x in str(args.seeds).split(",")]:
        args.seed = seed
        g = grpolab_side(args, tta)
        if not any(a != 0 for a in g["advantages"]):
            print(f"seed {seed}: every advantage of the first batch is 0 (rewards {sorted(g['rewards'])}): "
                  "no gradient on either side, nothing to compare", flush=True)
            results.append({"seed": seed, "all_advantages_zero": True})
            continue
        results.append(report(args, start, g, trl_side(args, tta, g)))
        del g  # two sides' weights and gradients (~0.5 GB each) need not outlive their seed
        gc.collect()
    print(json.dumps({"capability": capability, "task": args.task, "results": results}, default=str))


def report(args, start: torch.Tensor, g: dict, t: dict) -> dict:
    """Prints one seed's comparison; returns its figures."""
    groups = {}
    for r, reward, adv in zip(g["rollouts"], g["rewards"], g["advantages"]):
        groups.setdefault(r.prompt, []).append((reward, adv))
    print(f"seed {args.seed}; dtype: grpolab {g['dtype']}, TRL {t['dtype']}; "
          f"TRL pad id {t['pad_id']}, eos id {t['eos_id']}")
    print("rewards per prompt (grpolab): " + "; ".join(
        " ".join(f"{x[0]:.0f}" for x in sorted(v)) for v in groups.values()))
    print(f"rewards (sorted), grpolab: {sorted(g['rewards'])}; TRL: {sorted(t['rewards'])}")
    print(f"advantages, grpolab (sorted): {[round(a, 4) for a in sorted(g['advantages'])]}")
    print(f"advantages, TRL (sorted):     {[round(a, 4) for a in sorted(t['advantages'])]}")
    adv_diff = max(abs(a - b) for a, b in zip(sorted(g["advantages"]), sorted(t["advantages"])))
    print(f"largest advantage difference (sorted): {adv_diff:.3g}")
    print(f"optimizer, grpolab: {g['optimizer']}")
    print(f"optimizer, TRL:     {t['optimizer']}")
    print(f"TRL settings: {t['settings']}")
    figures = compare(start, g, t)
    figures["advantage_max_diff"] = adv_diff
    for k, v in figures.items():
        print(f"{k}: {v}", flush=True)
    return {"seed": args.seed, "dtype": g["dtype"], **figures,
            "optimizer": {"grpolab": g["optimizer"], "trl": t["optimizer"]}, "trl_settings": t["settings"]}

if __name__ == "__main__":
    main()
