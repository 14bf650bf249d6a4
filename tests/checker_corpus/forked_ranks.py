"""tests/checker_corpus/forked_ranks.py PEER.py --nproc-per-node N ARGS...: the peer's N ranks forked from one
process that has imported torch and transformers once, instead of N processes that each import them (what the
peer's own launch does). The ranks run the peer's code unchanged, under the same environment torchrun gives a
rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); only the start is shared. On two cores that is most of a
small replay's time: the imports take ~1.5 s of CPU per process, the replay of 8 small steps well under one.

Exit status: the first rank's that failed (the others are then ended), else 0.
"""
import os
import runpy
import signal
import socket
import sys
import traceback


def main():
    script, args = sys.argv[1], sys.argv[2:]
    ranks = int(args[args.index("--nproc-per-node") + 1])
    # Imported here once; every forked rank finds them in sys.modules. No torch operation runs before the
    # fork, so no thread pool exists yet to be lost in the children.
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    from transformers import BertForMaskedLM  # noqa: F401
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers"))
    children = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            sys.argv = [script] + args
            code = 0
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: B902 -- a rank's traceback, then its failure
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children.append(pid)
    status = 0
    while children:
        pid, wait_status = os.wait()
        children.remove(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in children:
                os.kill(other, signal.SIGTERM)
    sys.exit(status)


if __name__ == "__main__":
    main()
