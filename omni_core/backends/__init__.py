"""External trainers behind the same `sft` / `rl` stage (docs/design.md, "External trainers").

`omni_core.backends.verl`: verl's own trainers (`torchrun -m verl.trainer.sft_trainer`,
`python3 -m verl.trainer.main_ppo`) run as Ray Jobs on a cluster whose nodes share a path.
Nothing here imports verl: the job runs in verl's own environment (the CUDA image, or `.venv-verl`
for the tests), and this package only renders what it runs and stages what it reads.
"""
