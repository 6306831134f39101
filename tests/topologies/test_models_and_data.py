"""The example topologies: their data, models, configs and topology files (no processes).

Each topology is a folder of scripts importing their neighbours by plain name
(``from generator import ...``), as PERSIA's examples do; :func:`load` imports one
topology's modules in isolation so that equal names in different folders never mix.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import warnings
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from stream_persia.config import load_embedding_config, load_global_config
from stream_persia.embedding.data import PersiaBatch
from stream_persia.utils import roc_auc

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = ROOT / "topologies"
NAMES = ("synthetic_ctr", "adult_income", "taobao_ple")
_LOCAL = ("generator", "model", "schema", "source", "prepare", "data_loader", "train",
          "check_standalone")
ADULT_DIR = ROOT.parent / "shared" / "data" / "adult"


@cache
def load(name: str) -> SimpleNamespace:
    """Import a topology's own modules (plus ``common``) with its folder on sys.path."""
    folder = TOPOLOGIES / name
    saved = {m: sys.modules.pop(m) for m in _LOCAL if m in sys.modules}
    added = [p for p in (str(folder), str(TOPOLOGIES)) if p not in sys.path]
    sys.path[:0] = added
    try:
        mods = {m: importlib.import_module(m) for m in _LOCAL
                if (folder / f"{m}.py").is_file()}
        mods["common"] = importlib.import_module("common")
    finally:
        for p in added:
            sys.path.remove(p)
        for m in _LOCAL:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    return SimpleNamespace(folder=folder, topology=yaml.safe_load(
        (folder / "topology.yml").read_text()), **mods)


def emitted_batch(name: str) -> PersiaBatch:
    """A small batch as the topology's data loader sends it."""
    t = load(name)
    if name == "synthetic_ctr":
        stream = t.generator.ClickStream()
        return t.generator.to_persia_batch(stream.samples(0, 64), stream.slots)
    if name == "adult_income":
        enc = t.prepare.Encoder.fit(_adult_rows(t.prepare, ADULT_TRAIN))
        return t.data_loader.to_persia_batch(enc.encode(_adult_rows(t.prepare, ADULT_TRAIN)))
    return t.schema.to_persia_batch(t.generator.TaobaoStream().samples(0, 64))


# ----------------------------------------------------------------------------- all three
@pytest.mark.parametrize("name", NAMES)
def test_topology_file_names_existing_entries_configs_and_model(name):
    t = load(name)
    topo = t.topology
    assert topo["name"] == name
    roles = topo["roles"]
    for role in ("embedding_servers", "embedding_workers", "data_loaders"):
        assert isinstance(roles[role], int) and roles[role] >= 1
    assert roles["nn_workers"]["nproc_per_node"] >= 1
    assert isinstance(roles["api"], bool)
    for entry in topo["entry"].values():
        assert (t.folder / entry).is_file()
    for cfg in topo["config"].values():
        assert (t.folder / cfg).is_file()
    module, cls = topo["serving"]["model"].split(":")
    model = getattr(getattr(t, module), cls)(**(topo["serving"]["model_kwargs"] or {}))
    assert isinstance(model, torch.nn.Module)
    assert topo["tasks"] and all(isinstance(x, str) for x in topo["tasks"])
    for gate in topo.get("gates") or []:
        assert set(gate) == {"metric", "min"}


@pytest.mark.parametrize("name", NAMES)
def test_configs_load_and_every_emitted_slot_is_configured(name):
    t = load(name)
    schema = load_embedding_config(t.folder / t.topology["config"]["embedding"])
    load_global_config(t.folder / t.topology["config"]["global"])
    batch = emitted_batch(name)
    emitted = [f.name for f in batch.id_type_features]
    assert emitted == list(schema.slots)  # same slots, same order (the model's input order)


@pytest.mark.parametrize("name", NAMES)
def test_model_accepts_the_emitted_batch_and_backpropagates(name):
    t = load(name)
    topo = t.topology
    schema = load_embedding_config(t.folder / topo["config"]["embedding"])
    module, cls = topo["serving"]["model"].split(":")
    model = getattr(getattr(t, module), cls)(**(topo["serving"]["model_kwargs"] or {}))
    batch = emitted_batch(name)
    n = batch.batch_size
    emb = [torch.randn(n, schema.slot(f.name).dim, requires_grad=True)
           for f in batch.id_type_features]
    dense = [torch.from_numpy(np.asarray(f.data, np.float32))
             for f in batch.non_id_type_features]
    out = model(dense, emb)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    assert len(outs) == len(batch.labels) == len(topo["tasks"])
    for o, label in zip(outs, batch.labels, strict=True):
        assert o.shape == label.data.shape == (n, 1)
        assert ((o > 0) & (o < 1)).all()
    sum(torch.nn.functional.binary_cross_entropy(o, torch.from_numpy(lb.data))
        for o, lb in zip(outs, batch.labels, strict=True)).backward()
    assert all(e.grad is not None and e.grad.shape == e.shape for e in emb)
    # Checkpoints dump the TorchScript model for serving: every model must script.
    with warnings.catch_warnings():  # deprecated upstream; still what checkpoints write
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model.eval())
    with torch.no_grad():
        again = scripted(dense, [e.detach() for e in emb])
    again = list(again) if isinstance(again, (list, tuple)) else [again]
    for a, b in zip(again, outs, strict=True):
        torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("name", NAMES)
def test_data_loader_does_not_import_torch(name):
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TOPOLOGIES / name)!r}, {str(TOPOLOGIES)!r}]
        import data_loader
        assert "torch" not in sys.modules, "the data loader imported torch"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- settings
def test_settings_topology_defaults_then_env_then_flags(monkeypatch):
    t = load("synthetic_ctr")
    s = t.common.load_settings(t.folder, [])
    assert (s.samples, s.batch_size, s.embedding_staleness) == (1_000_000, 1024, 1)
    monkeypatch.setenv("STREAM_PERSIA_SAMPLES", "2e5")
    monkeypatch.setenv("EMBEDDING_STALENESS", "8")
    monkeypatch.setenv("PERSIA_OUTPUT_DIR", "/tmp/out")
    s = t.common.load_settings(t.folder, ["--batch-size", "256"])
    assert (s.samples, s.batch_size, s.embedding_staleness) == (200_000, 256, 8)
    assert s.checkpoint_dir == "/tmp/out/checkpoint"
    s = t.common.load_settings(t.folder, ["--samples", "1_000", "--data-dir", "/d"])
    assert (s.samples, s.data) == (1000, "/d")


@pytest.mark.parametrize("env,value", [("STREAM_PERSIA_SAMPLES", "many"),
                                       ("EMBEDDING_STALENESS", "0"),
                                       ("STREAM_PERSIA_BATCH_SIZE", "1.5")])
def test_settings_refuse_bad_values_naming_the_variable(monkeypatch, env, value):
    t = load("synthetic_ctr")
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as e:
        t.common.load_settings(t.folder, [])
    assert ("staleness" in str(e.value)) if value == "0" else (env in str(e.value))


def test_settings_refuse_a_key_given_twice_in_topology_yml(tmp_path):
    """An entry script run by hand reads topology.yml itself: a second ``run:`` section
    must not silently replace the first."""
    t = load("synthetic_ctr")
    text = (t.folder / "topology.yml").read_text()
    (tmp_path / "topology.yml").write_text(text.replace("  seed: 0\n", "  seed: 0\n  seed: 3\n"))
    with pytest.raises(SystemExit) as e:
        t.common.load_settings(tmp_path, [])
    assert "duplicate key 'seed'" in str(e.value) and "topology.yml" in str(e.value)


def test_metrics_file_is_json_and_replaced_whole(tmp_path):
    t = load("synthetic_ctr")
    s = t.common.RunSettings(samples=10, output_dir=str(tmp_path))
    m = t.common.MetricsLog("x", s, ["click"])
    m["auc"] = {"click": np.float64(0.75)}
    path = m.write()
    assert json.loads(path.read_text())["auc"] == {"click": 0.75}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    assert t.common.steps_per_rank(11, 2) == 5


# ----------------------------------------------------------------------------- synthetic
def test_click_stream_is_deterministic_and_chunking_free():
    g = load("synthetic_ctr").generator
    a, b = g.ClickStream(seed=3), g.ClickStream(seed=3)
    whole = a.samples(100, 300)
    parts = [b.samples(100 + lo, 100) for lo in (0, 100, 200)]
    for field in ("ids", "dense", "label", "p"):
        np.testing.assert_array_equal(getattr(whole, field),
                                      np.concatenate([getattr(p, field) for p in parts]))
    scattered = a.samples_at(np.array([399, 100, 250]))
    np.testing.assert_array_equal(scattered.ids, whole.ids[[299, 0, 150]])
    other = g.ClickStream(seed=4).samples(100, 300)
    assert not np.array_equal(other.ids, whole.ids)


def test_click_stream_schema_and_dtypes():
    g = load("synthetic_ctr").generator
    stream = g.ClickStream()
    s = stream.samples(0, 2000)
    assert s.ids.dtype == np.uint64 and s.ids.shape == (2000, 26)
    assert s.dense.dtype == np.float32 and s.dense.shape == (2000, 4)
    assert s.label.dtype == np.float32 and set(np.unique(s.label)) <= {0.0, 1.0}
    assert s.p.dtype == np.float64 and ((s.p > 0) & (s.p < 1)).all()
    assert stream.slots[0] == "C1" and stream.slots[-1] == "C26"
    # Slots never share ids, and eval samples are not training samples.
    assert len(np.intersect1d(s.ids[:, 0], s.ids[:, 1])) == 0
    ev = stream.eval_samples(10)
    assert ev.index[0] == g.EVAL_OFFSET


def test_click_stream_ids_follow_the_power_law():
    g = load("synthetic_ctr").generator
    stream = g.ClickStream()
    ranks = stream.ranks(np.arange(200_000))[:, 0]
    for r in (0, 1, 10):
        expected = 200_000 * stream.rank_probability(0, np.array([r]))[0]
        assert abs((ranks == r).sum() - expected) < 5 * np.sqrt(expected)
    assert ranks.max() > 1_000_000  # the tail really reaches millions of values


def test_click_stream_labels_come_from_the_hidden_model():
    g = load("synthetic_ctr").generator
    stream = g.ClickStream()
    s = stream.samples(0, 50_000)
    ranks = stream.ranks(s.index)
    logit = stream.bias + stream.dense_logit(s.dense) + sum(
        stream.id_weight(k, ranks[:, k]) for k in range(stream.num_slots) if stream.amps[k])
    np.testing.assert_allclose(s.p, 1 / (1 + np.exp(-logit)))
    n = len(s)
    assert abs(s.label.mean() - s.p.mean()) < 4 * np.sqrt(s.p.mean() / n)


def test_bayes_auc_matches_brute_force_pairs():
    g = load("synthetic_ctr").generator
    s = g.ClickStream().eval_samples(400)
    pos, neg = s.p[s.label == 1], s.p[s.label == 0]
    brute = ((pos[:, None] > neg[None, :]).sum()
             + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert roc_auc(s.label, s.p) == pytest.approx(brute, abs=1e-12)


def test_bayes_auc_of_true_probabilities_is_the_expected_auc_over_labels():
    """``streamgen.expected_auc``: the AUC of scoring by ``p`` averaged over the labels
    ``p`` draws (each sample ``p`` of a positive), checked against label draws."""
    g = load("synthetic_ctr").generator
    p = g.ClickStream(vocab_size=100).samples(0, 4000).p
    rng = np.random.default_rng(0)
    draws = [roc_auc((rng.random(len(p)) < p).astype(np.float32), p) for _ in range(200)]
    assert g.bayes_auc(p)[0] == pytest.approx(np.mean(draws), abs=3 * np.std(draws) / 14)
    assert g.bayes_auc(np.full(50, 0.3))[0] == 0.5      # ties count one half
    auc, err = g.ClickStream().bayes_auc(0, 50_000)
    assert 0.8 < auc < 0.9 and 0 < err < 0.003


def test_click_stream_settings_from_the_environment():
    g = load("synthetic_ctr").generator
    s = g.ClickStream.from_env(3, {"STREAM_PERSIA_CONCEPT_SHIFT_AT": "500",
                                   "STREAM_PERSIA_CONCEPT_SHIFT_LOGIT": "3",
                                   "STREAM_PERSIA_SYNTHETIC_VOCAB": "100"})
    assert (s.seed, s.shift_at, s.shift_logit, s.vocab_size) == (3, 500, 3.0, 100)
    assert g.ClickStream.from_env(0, {}) == g.ClickStream()
    assert int(g.ClickStream.from_env(0, {"STREAM_PERSIA_SYNTHETIC_VOCAB": "100"}).ranks(
        np.arange(5000)).max()) < 100
    for var, bad in (("STREAM_PERSIA_SYNTHETIC_VOCAB", "0"),
                     ("STREAM_PERSIA_SYNTHETIC_VOCAB", "many"),
                     ("STREAM_PERSIA_CONCEPT_SHIFT_AT", "-2"),
                     ("STREAM_PERSIA_CONCEPT_SHIFT_LOGIT", "x")):
        with pytest.raises(SystemExit, match=var):
            g.ClickStream.from_env(0, {var: bad})


def test_the_concept_shift_changes_the_bayes_auc_not_the_stream_before_it():
    g = load("synthetic_ctr").generator
    base, shifted = g.ClickStream(vocab_size=100), g.ClickStream(vocab_size=100,
                                                               shift_at=20_000, shift_logit=3)
    np.testing.assert_array_equal(base.samples(0, 20_000).p, shifted.samples(0, 20_000).p)
    after = shifted.samples(20_000, 20_000)
    changed = after.p != base.samples(20_000, 20_000).p
    assert 0.1 < changed.mean() < 0.3     # ranks 4..11 of slot C1
    assert shifted.bayes_auc(20_000, 50_000)[0] != base.bayes_auc(20_000, 50_000)[0]


def test_synthetic_batches_split_over_data_loaders_cover_each_sample_once():
    dl = load("synthetic_ctr").data_loader
    one = list(dl.batch_ranges(10_000, 1024, 0, 1))
    three = sorted(r for i in range(3) for r in dl.batch_ranges(10_000, 1024, i, 3))
    assert one == three and sum(n for _, n in one) == 10_000


def test_synthetic_batch_layout():
    t = load("synthetic_ctr")
    stream = t.generator.ClickStream()
    batch = t.generator.to_persia_batch(stream.samples(5, 32), stream.slots)
    assert batch.batch_size == 32 and len(batch.id_type_features) == 26
    assert batch.non_id_type_features[0].data.shape == (32, 4)
    assert batch.labels[0].data.shape == (32, 1)
    assert int.from_bytes(batch.meta, "little") == 5
    assert PersiaBatch.from_bytes(batch.to_bytes()).batch_size == 32


# ----------------------------------------------------------------------------- adult
ADULT_TRAIN = """\
39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K
50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, United-States, >50K
38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, Male, 0, 0, 40, ?, <=50K
53, Private, 234721, 11th, 7, Married-civ-spouse, Handlers-cleaners, Husband, Black, Female, 0, 0, 40, Cuba, >50K

"""
ADULT_TEST = """\
|1x3 Cross validator
25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, Peru, <=50K.
38, State-gov, 89814, HS-grad, 9, Married-civ-spouse, Adm-clerical, Husband, White, Female, 0, 1902, 50, Cuba, >50K.
"""


def _adult_rows(prepare, text: str) -> np.ndarray:
    return prepare.parse_lines(text.splitlines())


def _adult_dir(tmp_path: Path) -> Path:
    (tmp_path / "adult.data").write_text(ADULT_TRAIN)
    (tmp_path / "adult.test").write_text(ADULT_TEST)
    return tmp_path


def test_adult_vocabulary_is_fitted_on_train_only(tmp_path):
    prepare = load("adult_income").prepare
    train, test, enc = prepare.load(_adult_dir(tmp_path))
    assert (len(train), len(test)) == (4, 2)
    assert train.ids.dtype == np.uint64 and train.ids.shape == (4, 8)
    col = {c: k for k, c in enumerate(prepare.CATEGORICAL)}
    # Test-only categories (occupation Machine-op-inspct, relationship Own-child, Peru)
    # map to the reserved id; categories seen in training keep their training ids.
    assert test.ids[0, col["occupation"]] == prepare.UNSEEN
    assert test.ids[0, col["relationship"]] == prepare.UNSEEN
    assert test.ids[0, col["native_country"]] == prepare.UNSEEN
    assert test.ids[1, col["native_country"]] == train.ids[3, col["native_country"]]
    assert test.ids[1, col["workclass"]] == train.ids[0, col["workclass"]]
    assert (train.ids > 0).all()  # ? is a category of its own in training
    assert set(enc.vocab["native_country"]) == {"United-States", "?", "Cuba"}
    np.testing.assert_array_equal(train.label, [0, 1, 0, 1])
    np.testing.assert_array_equal(test.label, [0, 1])  # the trailing '.' is dropped
    np.testing.assert_allclose(train.dense.mean(axis=0), 0, atol=1e-6)
    assert train.dense.dtype == np.float32 and train.dense.shape == (4, 6)
    # Test numerics use the training statistics, not their own.
    assert abs(float(test.dense.mean(axis=0)[0])) > 0.1


def test_adult_rejects_a_malformed_row_naming_the_line(tmp_path):
    prepare = load("adult_income").prepare
    (tmp_path / "adult.data").write_text(ADULT_TRAIN + "1, 2, 3\n")
    with pytest.raises(ValueError, match=r"adult.data:6: expected 15"):
        prepare.read_rows(tmp_path / "adult.data")


def test_adult_missing_data_dir_says_where_to_get_it(tmp_path):
    prepare = load("adult_income").prepare
    with pytest.raises(SystemExit, match="UCI Machine Learning Repository"):
        prepare.resolve_data_dir(str(tmp_path))


def test_adult_epoch_orders_are_seeded_permutations():
    dl = load("adult_income").data_loader
    a, b = dl.epoch_order(100, 0, 1), dl.epoch_order(100, 0, 1)
    np.testing.assert_array_equal(a, b)
    assert sorted(a) == list(range(100))
    assert not np.array_equal(a, dl.epoch_order(100, 0, 2))


@pytest.mark.skipif(not (ADULT_DIR / "adult.data").is_file(),
                    reason=f"UCI Adult data not present in {ADULT_DIR}")
def test_adult_real_data_shapes():
    prepare = load("adult_income").prepare
    train, test, enc = prepare.load(prepare.resolve_data_dir(None))
    assert (len(train), len(test)) == (32_561, 16_281)
    assert train.label.mean() == pytest.approx(0.241, abs=5e-4)
    assert test.label.mean() == pytest.approx(0.236, abs=5e-4)
    assert enc.vocab_sizes()["sex"] == 3


# ----------------------------------------------------------------------------- taobao
def test_taobao_stream_is_deterministic_and_buy_implies_click():
    g = load("taobao_ple").generator
    a = g.TaobaoStream().samples(0, 5000)
    b = g.TaobaoStream().samples(2500, 2500)
    np.testing.assert_array_equal(a.clk[2500:], b.clk)
    np.testing.assert_array_equal(a.single["user_id"][2500:], b.single["user_id"])
    assert (a.buy <= a.clk).all() and a.buy.sum() > 0
    assert (a.p_buy <= a.p_click).all()
    # A user's attributes are a function of the user.
    users = a.single["user_id"]
    first = {int(u): i for i, u in enumerate(users)}
    idx = np.array([first[int(u)] for u in users])
    np.testing.assert_array_equal(a.single["age_level"], a.single["age_level"][idx])


def test_taobao_distribution_shift_changes_the_user_and_ad_mix_at_k():
    g = load("taobao_ple").generator
    k, n = 30_000, 10_000
    base, shifted = g.TaobaoStream(), g.TaobaoStream(shift_at=k)
    before, plain = shifted.samples(k - n, n), base.samples(k - n, n)
    for col in ("user_id", "adgroup_id", "cate_id"):   # nothing changes before K
        np.testing.assert_array_equal(before.single[col], plain.single[col])
    np.testing.assert_array_equal(before.p_click, plain.p_click)
    after, unshifted = shifted.samples(k, n), base.samples(k, n)

    def overlap(a, b, col):   # share of b's samples whose user / ad also occurs in a
        return np.isin(b.single[col], a.single[col]).mean()

    for col in ("user_id", "adgroup_id"):
        assert overlap(before, unshifted, col) > 0.5       # a stationary stream
        assert overlap(before, after, col) < 0.1           # the mix changed at K
    # The first shifted sample is K itself.
    assert shifted.samples(k - 1, 2).single["user_id"][0] == base.samples(k - 1, 1).single[
        "user_id"][0]
    assert shifted.samples(k, 1).single["user_id"][0] != base.samples(k, 1).single["user_id"][0]
    b_before, b_after = shifted.bayes_auc(0, 50_000), shifted.bayes_auc(k, 50_000)
    for task in ("click", "buy"):
        assert b_after[task][0] < b_before[task][0] - 0.02, (b_before, b_after)
        assert 0 < b_after[task][1] < 0.005
    with pytest.raises(ValueError, match="shift_fraction"):
        g.TaobaoStream(shift_fraction=1.0)


def test_taobao_shift_from_the_environment(monkeypatch, tmp_path):
    t = load("taobao_ple")
    assert t.generator.shift_at_from_env({}) == -1
    assert t.generator.shift_at_from_env({"STREAM_PERSIA_CONCEPT_SHIFT_AT": "7"}) == 7
    with pytest.raises(SystemExit, match="STREAM_PERSIA_CONCEPT_SHIFT_AT"):
        t.generator.shift_at_from_env({"STREAM_PERSIA_CONCEPT_SHIFT_AT": "soon"})
    monkeypatch.setenv("STREAM_PERSIA_CONCEPT_SHIFT_AT", "1000")
    plan = t.source.plan(t.common.RunSettings(samples=5000, eval_samples=10))
    assert plan.shift_at == 1000 and plan.stream().shift_at == 1000
    path = tmp_path / "one.csv"
    path.write_text("\n".join(t.generator.csv_lines(t.generator.TaobaoStream().samples(0, 50)))
                    + "\n")
    with pytest.raises(SystemExit, match="generated stream"):
        t.source.plan(t.common.RunSettings(data=str(path)))


def test_taobao_batch_matches_the_reference_schema():
    t = load("taobao_ple")
    batch = t.schema.to_persia_batch(t.generator.TaobaoStream().samples(0, 256))
    feats = {f.name: f for f in batch.id_type_features}
    assert len(feats) == 17 and "final_gender_code" not in feats
    for name, bucket in t.schema.BUCKETS.items():
        assert feats[name].values.max() < bucket
    assert feats["price"].values.max() < 50
    tags = feats["tag_category_list"]
    lengths = np.diff(tags.offsets)
    assert lengths.min() == 0 and lengths.max() == 5  # empty and full lists both occur
    assert [lb.name for lb in batch.labels] == ["click", "buy"]
    assert batch.non_id_type_features == []


def test_taobao_csv_round_trips_to_the_same_batch(tmp_path):
    t = load("taobao_ple")
    chunk = t.generator.TaobaoStream().samples(0, 300)
    path = tmp_path / "taobao.csv"
    path.write_text("\n".join(t.generator.csv_lines(chunk)) + "\n")
    assert all(len(line.split(",")) == 20 for line in path.read_text().splitlines())
    read = list(t.schema.read_csv(path, chunk_rows=128))
    assert [len(c) for c in read] == [128, 128, 44]
    a = t.schema.to_persia_batch(chunk)
    merged = t.schema.to_persia_batch(next(t.schema.read_csv(path, chunk_rows=300)))
    for fa, fb in zip(a.id_type_features, merged.id_type_features, strict=True):
        np.testing.assert_array_equal(fa.values, fb.values)
        np.testing.assert_array_equal(fa.offsets, fb.offsets)
    for la, lb in zip(a.labels, merged.labels, strict=True):
        np.testing.assert_array_equal(la.data, lb.data)


def test_taobao_csv_text_values_and_bad_rows(tmp_path):
    schema = load("taobao_ple").schema
    row = "1,0,pid_a,5,6,7,8,9,10,11,12,1,3,,2,0,1,a|b|c,,17"
    path = tmp_path / "x.csv"
    path.write_text(row + "\n" + row.replace("pid_a", "pid_b") + "\n")
    chunk = next(schema.read_csv(path))
    assert chunk.single["pid"][0] != chunk.single["pid"][1]     # hashed text
    assert chunk.single["pvalue_level"][0] == -1                 # missing value
    values, offsets = chunk.multi["tag_category_list"]
    assert list(offsets) == [0, 3, 6] and len(set(values[:3])) == 3
    assert list(chunk.multi["tag_brand_list"][1]) == [0, 0, 0]   # empty lists
    path.write_text(row + "\n" + "1,0,2\n")
    with pytest.raises(ValueError, match="row 2"):
        list(schema.read_csv(path))


def test_taobao_data_plan(tmp_path):
    t = load("taobao_ple")
    s = t.common.RunSettings(samples=0, eval_samples=10)
    path = tmp_path / "one.csv"
    path.write_text("\n".join(t.generator.csv_lines(t.generator.TaobaoStream().samples(0, 100)))
                    + "\n")
    plan = t.source.plan(t.common.RunSettings(samples=0, eval_samples=10, data=str(path)))
    assert (plan.kind, plan.train_rows, plan.eval_rows) == ("csv", 90, 10)
    assert sum(len(c) for c in plan.train_batches(32)) == 90
    assert sum(len(c) for c in plan.eval_batches(32)) == 10
    assert t.source.plan(s).kind == "generated"
    with pytest.raises(SystemExit, match="taobao_train_data"):
        t.source.plan(t.common.RunSettings(data=str(tmp_path)))
    with pytest.raises(SystemExit, match="no such file"):
        t.source.plan(t.common.RunSettings(data=str(tmp_path / "missing.csv")))


def test_ple_gates_mix_experts_per_task():
    model = load("taobao_ple").model
    layer = model.CGCLayer(8, num_tasks=2, experts_per_task=2, shared_experts=1,
                           expert_hidden=(4,), shared_output=True)
    x = torch.randn(5, 8)
    outs, shared = layer([x, x], x)
    assert [o.shape for o in outs] == [(5, 4), (5, 4)] and shared.shape == (5, 4)
    # Each task output is a convex mix of its own and the shared experts' outputs.
    branch = layer.branches[0]
    experts = torch.stack([e(x) for e in branch.experts]
                          + [e(x) for e in layer.shared_experts], dim=1)
    assert ((outs[0] >= experts.min(1).values - 1e-6)
            & (outs[0] <= experts.max(1).values + 1e-6)).all()
    ple = model.PLE(num_slots=3, embedding_dim=4, levels=3)
    out = ple([], [torch.randn(7, 4) for _ in range(3)])
    assert len(out) == 2 and all(o.shape == (7, 1) for o in out)
