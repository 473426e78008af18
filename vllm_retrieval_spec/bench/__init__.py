"""What ``vllm-rsd bench``, ``calibrate`` and ``demo`` run: the benchmark tasks, the throughput
runner, the verification-cost measurement and the results files they write."""
