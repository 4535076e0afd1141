"""Shared test helpers: build tiny random checkpoints with transformers and compare against them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.config import ModelLoadConfig
from moetier.weights.loader import LoadedModel, load_model


def save_tiny(hf_config, path: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """Instantiate ``hf_config`` with random weights and save it in ``dtype`` with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _randomize_buffers(model)
    model.to(dtype).save_pretrained(path)


def load_reference(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The saved checkpoint as transformers loads it, computing in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _randomize_buffers(model) -> None:
    """Give zero-initialised router biases values, so a test cannot pass by ignoring them."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@dataclass
class Comparison:
    prefill_error: float
    last_error: float
    step_errors: list[float]
    ours_tokens: list[int]
    reference_tokens: list[int]


@torch.no_grad()
def reference_run(hf_model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers' prefill logits, then its own cached greedy decoding for ``steps`` tokens."""
    device = next(hf_model.parameters()).device
    out = hf_model(prompt[None].to(device), use_cache=True)
    prefill = out.logits[0].float().cpu()
    past, token = out.past_key_values, int(prefill[-1].argmax())
    step_logits, tokens = [], []
    for _ in range(steps):
        tokens.append(token)
        out = hf_model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        step_logits.append(out.logits[0, -1].float().cpu())
        token = int(step_logits[-1].argmax())
    return prefill, step_logits, tokens


@torch.no_grad()
def moetier_run(
    loaded: LoadedModel, prompt: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Our prefill logits and greedy cached decoding, the same protocol as :func:`reference_run`."""
    model = loaded.model
    cache = model.new_cache(prompt.shape[0] + steps + 1)
    prefill = model.compute_logits(model(prompt.to(model.device), cache)).cpu()
    token = int(prefill[-1].argmax())
    step_logits, tokens = [], []
    for _ in range(steps):
        tokens.append(token)
        logits = model.compute_logits(model(torch.tensor([token], device=model.device), cache))[-1].cpu()
        step_logits.append(logits)
        token = int(logits.argmax())
    return prefill, step_logits, tokens


def assert_same_run(run: tuple, reference: tuple, rel: float = 1e-6) -> None:
    """Two :func:`moetier_run` results agree: the same greedy tokens, prefill and every step's logits within ``rel``."""
    (prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens) = run, reference
    assert tokens == ref_tokens
    assert relative_error(prefill, ref_prefill) < rel
    assert max(relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)) < rel


def compare_with_transformers(
    hf_model, path: Path, dtype=torch.float32, prompt_len=48, steps=32, seed=1, device="cpu"
) -> Comparison:
    """Load ``path`` with moetier and run both implementations over the same random prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, hf_model.config.vocab_size, (prompt_len,), generator=generator)
    ref_prefill, ref_steps, ref_tokens = reference_run(hf_model, prompt, steps)
    loaded = load_model(path, ModelLoadConfig(dtype=dtype, device=device), progress=False)
    prefill, ours_steps, ours_tokens = moetier_run(loaded, prompt, steps)
    return Comparison(
        prefill_error=relative_error(prefill, ref_prefill),
        last_error=relative_error(prefill[-1], ref_prefill[-1]),
        step_errors=[relative_error(a, b) for a, b in zip(ours_steps, ref_steps, strict=True)],
        ours_tokens=ours_tokens,
        reference_tokens=ref_tokens,
    )


@torch.inference_mode()
def greedy_groups(
    model, groups: tuple[int, ...] = (1, 2, 4), steps: int = 8, mixed_capacities: bool = False
) -> tuple[list[list[int]], list]:
    """Batched prefill of a group of sequences per size in ``groups``, then ``steps`` greedy decode steps of
    every group in turn (batch sizes alternate, so decode graphs of several sizes share their pool).
    ``mixed_capacities``: each sequence's cache of its own size (96, 76, 56, ... tokens), as the engine sizes
    them (prompt + max_tokens), else all of 96. Returns the tokens per group and the logits per step (on the CPU)."""
    generator = torch.Generator().manual_seed(9)
    vocab, device = model.config.vocab_size, model.device
    runs = []
    for size in groups:
        lengths = [9 + 5 * i for i in range(size)]
        caches = [model.new_cache(96 - 20 * i if mixed_capacities else 96) for i in range(size)]
        prompt = torch.randint(0, vocab, (sum(lengths),), generator=generator).to(device)
        hidden = model(prompt, caches, lengths)
        last = torch.tensor([sum(lengths[: i + 1]) - 1 for i in range(size)], device=device)
        runs.append((caches, model.compute_logits(hidden[last]).argmax(-1)))
    tokens: list[list[int]] = [[] for _ in groups]
    logits = []
    for _ in range(steps):
        for g, (caches, next_tokens) in enumerate(runs):
            step_logits = model.compute_logits(model(next_tokens, caches, [1] * len(caches)))
            logits.append(step_logits.cpu())
            tokens[g].extend(next_tokens.tolist())
            runs[g] = (caches, step_logits.argmax(-1))
    return tokens, logits


def run_kernel_check(script: str, device: str) -> list[dict]:
    """Run a kernel check ``script`` (Python source taking the device as its first argument and printing a JSON list
    last) in a fresh interpreter: on ``device`` "cpu" under Triton's interpreter (which must be set before Triton is
    imported, hence the subprocess)."""
    here = os.path.dirname(os.path.abspath(__file__))  # the scripts import helpers from here (interpreted.py)
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    done = subprocess.run([sys.executable, "-c", script, device], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
