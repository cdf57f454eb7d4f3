"""The tools' one way of writing their JSON results: whole or not at all (a reader, or a kill mid-write,
never sees half a file), the folder made if missing."""

import json
import os


def save_json(obj, path, sort_keys=False):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=sort_keys)
    os.replace(tmp, path)
