"""verl's CPU rollout (`omni_cpu`, omni_core/backends/verl/runtime/omni_verl_cpu_rollout.py), its server
driven in verl's own interpreter as verl's agent loop drives it (tests/verl_cpu/rollout_groups.py): a
prompt's n samples generated together (one forward of n rows a token), the same samples whatever the
requests' arrival order and timing, greedy validation requests alone, a group that never fills run after
the wait, and the rows' log-probs those of one forward over prompt + response (what the actor computes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from verl_env import verl_python

from omni_core.models.tiny import tiny_model_dir

PROBE = Path(__file__).with_name("verl_cpu") / "rollout_groups.py"


def test_a_prompts_samples_are_generated_together_and_reproducibly():
    out = subprocess.run([verl_python(), str(PROBE), str(tiny_model_dir("lm"))], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    budget = 6  # response_length
    assert seen["batches"][:budget] == [4] * budget  # n = 4 rows in every forward (then the recompute's)
    assert seen["staggered_batches"] == [4] * budget  # requests 0.1-0.3 s apart still form one group
    assert seen["together"] == seen["apart"]  # the same samples and log-probs, whatever the arrival
    assert len({tuple(tokens) for tokens, _ in seen["together"]}) == 4  # each row its own draw
    assert seen["greedy_batches"] == [1] * budget  # validation's sampling: val_kwargs.n = 1
    assert seen["partial"] == 3 and seen["partial_batches"] == [3] * budget  # 3 of 4 ran after the wait
    assert seen["logprob_diff_max"] < 1e-5
