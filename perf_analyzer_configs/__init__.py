"""perf_analyzer load tests of mm_qa / mm_qa_bls: input-data JSON, its generator, the runner.

Run the modules from the repository root, e.g. `.venv/bin/python -m perf_analyzer_configs.run --help`;
README.md in this folder has the commands.
"""
