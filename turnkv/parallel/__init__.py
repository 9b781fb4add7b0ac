"""Tensor parallelism: the processes of an engine over several devices (launch.py), the commands rank 0
sends its workers (mirror.py, worker_loop.py). The model's sharding is turnkv/model/parallel.py."""
