"""Beam jobs: raw samples -> multi-prefix-tree shards (batch), Kafka samples -> tree batches
(streaming), and the data generator and Kafka replay tools around them."""

from compression.cli import drop_log_messages

# Importing apache_beam logs "apitools not found, and bigquery client libraries are not
# available ..." on the root logger when the GCP extras are not installed (they are not
# needed here): drop that one message, before any job imports Beam.
drop_log_messages("apitools not found")
