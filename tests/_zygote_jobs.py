"""Toy entry points for tests/test_zygote.py, called in processes the fork server forks."""
import os
import sys
import time


def report(args):
    """Print what the child was given: its arguments, an env variable, torch's threads, the data
    read from a passed fd, and how many threads the process has (a fork of a one-thread server)."""
    import torch

    fd = int(args[0])
    data = os.read(fd, 100).decode()
    print(f"args={args[1:]} env={os.environ.get('ZYGOTE_TEST')} threads={torch.get_num_threads()} "
          f"fd_data={data} tasks={len(os.listdir('/proc/self/task'))} cwd={os.getcwd()}", flush=True)
    return int(os.environ.get("ZYGOTE_EXIT", "0"))


def fail(args):
    raise ValueError(f"boom: {args}")


def sleep(args):
    print(f"sleeping pid={os.getpid()}", flush=True)
    time.sleep(float(args[0]) if args else 600)
    sys.exit(3)
