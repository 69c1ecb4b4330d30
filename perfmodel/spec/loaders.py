"""Load a model by what the user typed: a preset name, a preset-format .toml or a Hugging Face
config.json (perfmodel.spec.hf)."""
from __future__ import annotations

from perfmodel.spec.arch import ModelSpec, from_dict, preset_data, read_toml
from perfmodel.util.errors import in_file, require
from perfmodel.util.files import check_path


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (`perfmodel list`), a preset-format .toml file or an HF config.json (or a
    directory holding one)."""
    p = check_path("--model", name_or_path)
    if p.suffix == ".json" or (p.is_dir() and (p / "config.json").exists()):
        from perfmodel.spec import hf   # imported here: a preset or .toml needs none of it
        return hf.from_hf_config(p / "config.json" if p.is_dir() else p)
    if p.suffix == ".toml":
        require(p.exists(), "model", name_or_path, "file not found")
        data = read_toml(p, (str(p.resolve()),))
        with in_file(p):
            return from_dict(data)
    return from_dict(preset_data(name_or_path))
