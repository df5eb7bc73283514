"""The `shapes` example: a classifier the project trains itself, registered like a user's model and
served by the workflow runtime; its answers are right, so its weights mean something."""

from __future__ import annotations

import numpy as np

from streambox.kernel_compiler import registry
from streambox.workflows.engine import Engine
from streambox.workflows.examples import load_example, sample_event
from streambox.workflows.examples.imaging import encode_image
from streambox.workflows.examples.shapes_model import CLASSES, draw_shape


def test_the_trained_shapes_model_names_shapes_through_the_workflow(pool, make_invoker, run, monkeypatch):
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(pool.root))
    spec = load_example("shapes", small=True)  # trains and registers the model in this pool, once
    assert spec.functions["classify"].models == ["shapes"]  # declared by the decorator only
    record = registry.find(pool.root, "shapes")
    assert record is not None and record.source_kind == "factory"
    assert record.batches[0].max_abs_diff < 1e-4
    load_example("shapes")  # a second use finds it registered: no new version
    assert [r.ref for r in registry.registered(pool.root)] == [record.ref]

    rng = np.random.default_rng(2024)  # pictures the model never saw (training uses seed 0)
    truth = [CLASSES[i % len(CLASSES)] for i in range(24)]
    events = [{"image": encode_image(draw_shape(kind, rng))} for kind in truth]

    async def go():
        engine = Engine(make_invoker())
        await engine.deploy(spec)
        try:
            results = [await engine.run("shapes", e) for e in events]
            sampled = await engine.run("shapes", sample_event("shapes", 4))
        finally:
            await engine.close()
        return results, sampled

    results, sampled = run(go())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    answers = [r.output["shape"] for r in results]
    right = sum(a == t for a, t in zip(answers, truth, strict=True))
    assert right >= 21, list(zip(answers, truth, strict=True))  # 98% on held-out pictures; chance is 8
    assert sampled.ok and sampled.output["shape"] == CLASSES[4 % len(CLASSES)]
