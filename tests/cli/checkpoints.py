"""tests/cli/checkpoints.py — damage done to a checkpoint's files (tests/cli/checkpoints.sh)."""
import sys


def master_not_an_object(path):
    """A rank file whose safetensors header says "master":5 where an object stood (its length kept)."""
    b = bytearray(open(path, "rb").read())
    n = int.from_bytes(b[:8], "little")
    h = b[8:8 + n].decode().replace('"master":{', '"master":5,"x":{', 1)
    b[8:8 + n] = h.encode()[:n].ljust(n)
    open(path, "wb").write(b)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
