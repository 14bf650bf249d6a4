"""tests/cli/reliability.py — the reliability checks' file readers (tests/cli/reliability.sh)."""
import json
import os
import socket
import struct
import sys


def one_export(directory):
    """Exit 0 when the export's config.json and model.safetensors come from one run (their hidden sizes agree)."""
    config = json.load(open(f"{directory}/config.json"))
    with open(f"{directory}/model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    sys.exit(0 if header["bert.embeddings.word_embeddings.weight"]["shape"][1] == config["hidden_size"] else 1)


def bind_socket(path):
    """A Unix socket at path (an output that is not a file)."""
    socket.socket(socket.AF_UNIX).bind(path)


def whole_safetensors(path):
    """'whole' when the file ends where its header's last tensor ends, else 'cut'."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    print("whole" if os.path.getsize(path) == 8 + length + end else "cut")


def metrics_steps(path):
    """Each --metrics line's step, R after it for a resumed_from line."""
    print(" ".join(str(r.get("step")) + ("R" if "resumed_from" in r else "") for r in map(json.loads, open(path))))


def deep_json():
    """JSON arrays nested 100,000 deep."""
    print("[" * 100000 + "]" * 100000)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
