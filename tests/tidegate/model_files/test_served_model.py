"""Served models: from --model, TIDEGATE_MODELS or a models file, named, checked; and which
model (and adapter) a request's ``model`` and ``lora`` name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidegate import keys
from tidegate.model_files.model_catalog import LoraMismatch, ModelCatalog, ModelNotFound
from tidegate.model_files.served_model import ServedModelError, served_models
from tidegate.settings import Settings


def test_the_default_is_the_one_model_setting_named_key_safe() -> None:
    [model] = served_models(Settings(model="random:tiny"))
    assert (model.name, model.spec, model.aliases, dict(model.loras)) == (
        "random_tiny", "random:tiny", (), {})


def test_models_are_spec_or_name_eq_spec_the_first_the_default() -> None:
    models = served_models(Settings(models="chat=random:tiny, code=random:tiny"))
    assert [(m.name, m.spec) for m in models] == [("chat", "random:tiny"),
                                                 ("code", "random:tiny")]


def test_a_models_file_in_toml_gives_each_model_its_options(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('''
[[models]]
name = "chat"
spec = "random:tiny"
aliases = ["meta-llama/Llama-3-8B", "llama"]
engine = { max_num_seqs = 8, kv_cache_gb = 0.5, max_loras = 2 }
loras = { sql = "/adapters/sql" }

[[models]]
spec = "random:tiny"
''')
    chat, other = served_models(Settings(models_file=str(path), model="ignored"))
    assert (chat.name, chat.aliases, dict(chat.engine), dict(chat.loras)) == (
        "chat", ("meta-llama/Llama-3-8B", "llama"),
        {"max_num_seqs": 8, "kv_cache_gb": 0.5, "max_loras": 2}, {"sql": "/adapters/sql"})
    assert other.name == "random_tiny"
    own = chat.settings(Settings(max_num_seqs=32, kv_cache_gb=2.0, device="cpu"))
    assert (own.model, own.max_num_seqs, own.kv_cache_gb, own.max_loras) == (
        "random:tiny", 8, 0.5, 2)


def test_a_models_file_in_json_is_a_list_or_an_object(tmp_path: Path) -> None:
    for doc in ([{"name": "a", "spec": "random:tiny"}],
                {"models": [{"name": "a", "spec": "random:tiny"}]}):
        path = tmp_path / "models.json"
        path.write_text(json.dumps(doc))
        assert [m.name for m in served_models(Settings(models_file=str(path)))] == ["a"]


def test_lora_flags_add_adapters_to_the_first_model() -> None:
    first, second = served_models(Settings(models=["a=random:tiny", "b=random:tiny"],
                                           loras=["sql=/x/sql", "chat=/x/chat"]))
    assert dict(first.loras) == {"sql": "/x/sql", "chat": "/x/chat"} and not second.loras


@pytest.mark.parametrize(("settings", "message"), [
    ({"models": ["a=random:tiny", "a=random:tiny"]}, "'a' is given to two models"),
    ({"models": ["a=random:tiny", "tidegate=random:tiny"]}, "'tidegate'"),
    ({"loras": ["no-path"]}, "expected NAME=PATH"),
    ({"loras": ["bad name=/x"]}, "adapter name 'bad name'"),
    ({"loras": ["a=/x", "a=/y"]}, "given twice"),
    ({"models": ["random:no-such-preset"]}, "no-such-preset"),
])
def test_bad_values_are_refused_with_a_clear_message(settings: dict, message: str) -> None:
    with pytest.raises((ServedModelError, ValueError), match=message):
        served_models(Settings(model="random:tiny", **settings))


@pytest.mark.parametrize(("text", "message"), [
    ("[[models]]\nname = 'a'\n", r"'spec' \(a string\) is required"),
    ("[[models]]\nspec = 'random:tiny'\nengine = { max_num_seq = 4 }\n",
     "unknown engine option 'max_num_seq'"),
    ("[[models]]\nspec = 'random:tiny'\nengine = { max_num_seqs = 0 }\n",
     "engine option max_num_seqs: Input should be greater than or equal to 1"),
    ("[[models]]\nspec = 'random:tiny'\nengine = { device = 'cuda' }\n",
     "unknown engine option 'device'"),
    ("[[models]]\nspec = 'random:tiny'\ncolour = 'red'\n", "unknown key 'colour'"),
    ("[[models]]\nname = 'a b'\nspec = 'random:tiny'\n", "model name 'a b'"),
    ("[[models]]\nname = 'a'\nspec = 'random:tiny'\naliases = ['x']\n"
     "[[models]]\nname = 'b'\nspec = 'random:tiny'\naliases = ['x']\n", "'x' is given to two"),
    ("models = 3", "expected a non-empty list of models"),
    ("[[models", "not valid TOML"),
])
def test_a_bad_models_file_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ServedModelError, match=message) as info:
        served_models(Settings(models_file=str(path)))
    assert str(path) in str(info.value)


def test_an_unreadable_models_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServedModelError, match="cannot read the models file"):
        served_models(Settings(models_file=str(tmp_path / "missing.toml")))


# ---------------------------------------------------------------- catalog


@pytest.fixture
def catalog(tmp_path: Path) -> ModelCatalog:
    path = tmp_path / "models.json"
    path.write_text(json.dumps([{"name": "chat", "spec": "random:tiny", "aliases": ["llama"]},
                                {"name": "code", "spec": "random:smollm2-135m"}]))
    return ModelCatalog(served_models(Settings(models_file=str(path))))


def test_every_name_of_a_model_chooses_it(catalog: ModelCatalog) -> None:
    for name, served in (("chat", "chat"), ("llama", "chat"), ("tidegate", "chat"),
                         ("random:tiny", "chat"), ("code", "code"),
                         ("random:smollm2-135m", "code"), (None, "chat")):
        choice = catalog.choose(name)
        assert (choice.model.name, choice.adapter) == (served, None), name


def test_base_colon_name_is_an_adapter_only_of_a_known_model(catalog: ModelCatalog) -> None:
    choice = catalog.choose("llama:sql")
    assert (choice.model.name, choice.adapter, choice.adapter_field) == ("chat", "sql", "model")
    choice = catalog.choose("random:tiny:sql")  # a spec with a ':' of its own
    assert (choice.model.name, choice.adapter) == ("chat", "sql")
    assert catalog.choose("code", lora="py").adapter == "py"
    assert catalog.choose("code:py", lora="py").adapter == "py"
    for unknown in ("gpt-4o", "gpt:4o", "random:nope", "chat:bad name"):
        with pytest.raises(ModelNotFound) as info:
            catalog.choose(unknown)
        assert info.value.field == "model" and "chat, code" in str(info.value)


def test_a_lora_that_disagrees_with_the_model_suffix_is_refused(catalog: ModelCatalog) -> None:
    with pytest.raises(LoraMismatch, match="'sql'.*'py'"):
        catalog.choose("chat:sql", lora="py")


def test_lane_names_carry_the_model_and_parse_back() -> None:
    stream = keys.lane_stream("Llama-3.1-8B", "batch", 2)
    assert stream == "tidegate:lane:{Llama-3.1-8B.batch.2}"
    assert keys.parse_lane_stream(stream) == ("Llama-3.1-8B", "batch", 2)
    assert keys.lane_stream("a", "interactive") != keys.lane_stream("b", "interactive")
    for other in ("tidegate:lane:{interactive.0}", "tidegate:job:{x}", "tidegate:lane:{m.x.0}"):
        assert keys.parse_lane_stream(other) is None
    assert keys.adapters("m") == "tidegate:adapters:{m}"
    assert keys.adapter_loads("m") == "tidegate:adapter-loads:{m}"
