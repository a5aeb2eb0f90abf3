"""Helpers of the trainer tests: paths and small generated tables of the taobao_like schema."""
import os

import pyarrow as pa

from pipelines.generate import generate_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")


def generated(schema, samples, seed, samples_per_user=10.0, ctr=0.2):
    """Raw samples from the project's generator, with the true probabilities ``p_<label>``."""
    return pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                 samples_per_user=samples_per_user, ctr=ctr,
                                                 with_probabilities=True)))
