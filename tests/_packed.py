"""Packed documents: a row of documents (segment ids, RoPE positions restarting) gives each
document the logits it has alone."""
import jax
import jax.numpy as jnp
import numpy as np


def assert_documents_alone(model, docs, atol):
    """Packs ``docs`` (1-D int token arrays) into one row and checks each document's
    logits in it against the model's logits of the document alone."""
    row = jnp.concatenate(docs)[None]
    seg = jnp.asarray([sum(([i + 1] * len(d) for i, d in enumerate(docs)), [])])
    pos = jnp.asarray([sum((list(range(len(d))) for d in docs), [])])
    logits = jax.jit(lambda t, **kw: model(t, **kw)[0])
    packed = np.asarray(logits(row, segment_ids=seg, positions=pos), np.float64)
    at = 0
    for d in docs:
        alone = np.asarray(logits(d[None]), np.float64)[0]
        np.testing.assert_allclose(packed[0, at:at + len(d)], alone, atol=atol)
        at += len(d)
