"""The job machinery both external backends (verl, verl_omni) share; neither reaches around it into
the other's modules:

- `options`: the options base (`shared_dir`, `entrypoint_resources`, the run-key rules) and the checks
  of a stage run as a Ray Job;
- `job`: submit (a `JobCommand`: entry point + env), follow, stop, helper jobs, cancellation;
- `mirror`: the trainer's checkpoints on the shared path <-> the store (`upload_file` for what a
  backend adds after the job);
- `export`: dataset versions and models staged on the shared path;
- `runner`: the runner skeleton (`run_job` with a backend's `JobTrainer`), verl's model merger as a
  helper job, and the commit of a Hugging Face folder into the final checkpoint.
"""
