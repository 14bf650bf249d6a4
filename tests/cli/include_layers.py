#!/usr/bin/python3
"""tests/cli/include_layers.py [--root DIR] [BUILD]: the trainer's includes form layers.

trainer/ is layered (notes/07, "The trainer's layers"), lowest first:

    settings -> inputs -> formats -> training

Each header names its layer at its top in one line,

    // Layer: inputs, of settings → inputs → formats → training (notes/07, ...)

and so does train_bert_mini.cu, the top's own file. A module is a header
with its .cpp (trainer/inputs.h and trainer/inputs.cpp), or
train_bert_mini.cu alone; a .cpp is in its header's layer. Checked:

  - every header, and train_bert_mini.cu, names its layer, in the one order;
  - every `#include "trainer/X.h"` goes to X's layer or one below the
    includer's own: a lower layer never includes a higher one (a file may
    include its own layer's headers);
  - no module is on a cycle of includes (the module including a header whose
    module includes it back, directly or through others): a cycle is what
    makes two files one to read.

Prints each failure with its reason, then "N passed, M failed"; exits 1 when
any check failed. BUILD (tests/run_tests.sh passes its build directory) is
ignored: this reads the sources only. --root DIR reads another checkout.
"""
import os
import re
import sys

LAYER_LINE = re.compile(r"^// Layer: (\w+), of (\w+(?: → \w+)+) ")
INCLUDE = re.compile(r'^\s*#\s*include\s+"(?:\.\./)?(trainer/\w+)\.h"')


def module_of(path):
    """trainer/inputs.cpp -> trainer/inputs; train_bert_mini.cu -> train_bert_mini."""
    return os.path.splitext(path)[0]


def read_sources(root):
    files = ["train_bert_mini.cu"]
    files += sorted("trainer/" + name for name in os.listdir(os.path.join(root, "trainer"))
                    if name.endswith((".h", ".cpp")))
    texts = {}
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            texts[path] = f.read().splitlines()
    return texts


def main(argv):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    if "--root" in argv:
        root = argv[argv.index("--root") + 1]
    texts = read_sources(root)
    passed, failed = 0, 0

    def check(ok, what):
        nonlocal passed, failed
        if ok:
            passed += 1
        else:
            failed += 1
            print("FAIL:", what)

    # Each module's layer, from its header's (or train_bert_mini.cu's) line.
    layer, orders = {}, {}
    for path, lines in texts.items():
        if not (path.endswith(".h") or path == "train_bert_mini.cu"):
            continue
        named = [LAYER_LINE.match(line) for line in lines[:40]]
        named = [m for m in named if m]
        check(len(named) == 1, f"{path} names its layer in one line near its top ('// Layer: NAME, of "
                               f"settings → inputs → formats → training ...'): found {len(named)}")
        if len(named) == 1:
            order = named[0].group(2).split(" → ")
            orders[path] = order
            check(named[0].group(1) in order, f"{path}: layer '{named[0].group(1)}' is not in its own order")
            if named[0].group(1) in order:
                layer[module_of(path)] = order.index(named[0].group(1))
    if orders:
        first = next(iter(orders.values()))
        for path, order in orders.items():
            check(order == first, f"{path} gives the order {' → '.join(order)}, others {' → '.join(first)}")
        names = first
    else:
        names = []

    def name(module):
        return names[layer[module]] if module in layer and layer[module] < len(names) else "?"

    # The includes, by module; each one that reaches a module whose layer is
    # known is checked for direction.
    edges = {}
    for path, lines in texts.items():
        here = module_of(path)
        for number, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            there = m.group(1)
            if not os.path.exists(os.path.join(root, there + ".h")):
                check(False, f"{path}:{number} includes {there}.h, which is not there")
                continue
            if there == here:
                continue
            edges.setdefault(here, set()).add(there)
            if here in layer and there in layer:
                check(layer[there] <= layer[here],
                      f"{path}:{number} includes {there}.h: {name(here)} includes {name(there)}, a layer above it")

    # Cycles: a module is on one when it can reach itself.
    modules = sorted(set(edges) | {m for targets in edges.values() for m in targets})

    def path_back(start):
        """The shortest chain of includes from `start` back to itself, or None."""
        frontier, seen = [[start]], {start}
        while frontier:
            next_frontier = []
            for chain in frontier:
                for there in sorted(edges.get(chain[-1], ())):
                    if there == start:
                        return chain + [start]
                    if there not in seen:
                        seen.add(there)
                        next_frontier.append(chain + [there])
            frontier = next_frontier
        return None

    for module in modules:
        cycle = path_back(module)
        check(cycle is None, f"{module} is on a cycle of includes: {' -> '.join(cycle or [])}")

    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
