"""Pipeline parallelism: stage partitioning, point-to-point transfer, the 1F1B schedule."""
