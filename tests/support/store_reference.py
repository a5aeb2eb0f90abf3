"""Pure-numpy reference of the store's optimizer maths and duplicate summation (float32)."""
import numpy as np

import native

F32 = np.float32


def sum_duplicates(ids, grads):
    """Distinct ids in order of first appearance and their gradients summed in input order."""
    order, sums = [], {}
    for i, id_ in enumerate(ids.tolist()):
        if id_ not in sums:
            order.append(id_)
            sums[id_] = grads[i].astype(F32).copy()
        else:
            sums[id_] = (sums[id_] + grads[i]).astype(F32)
    return order, [sums[i] for i in order]


def initial_state(optimizer, dim):
    """Optimizer state of a new row, as the store lays it out (width * dim floats)."""
    if isinstance(optimizer, native.SGD):
        return np.zeros(0, F32)
    if isinstance(optimizer, native.Adagrad):
        return np.full(dim, optimizer.initial_accumulator, F32)
    return np.zeros(2 * dim, F32)


def update(optimizer, w, state, g, t):
    """One optimizer step on float32 vectors; returns new (w, state). t counts this update."""
    w, state, g = w.astype(F32).copy(), state.astype(F32).copy(), g.astype(F32)
    dim = w.shape[0]
    if isinstance(optimizer, native.SGD):
        return (w - F32(optimizer.lr) * g).astype(F32), state
    if isinstance(optimizer, native.Adagrad):
        acc = (state + g * g).astype(F32)
        return (w - F32(optimizer.lr) * g / np.sqrt(acc)).astype(F32), acc
    if isinstance(optimizer, native.Adam):
        b1, b2 = F32(optimizer.beta1), F32(optimizer.beta2)
        m = (b1 * state[:dim] + (F32(1) - b1) * g).astype(F32)
        v = (b2 * state[dim:] + (F32(1) - b2) * (g * g)).astype(F32)
        c1 = F32(1.0 - float(b1) ** t)
        c2 = F32(1.0 - float(b2) ** t)
        w = w - F32(optimizer.lr) * (m / c1) / (np.sqrt(v / c2) + F32(optimizer.epsilon))
        return w.astype(F32), np.concatenate([m, v])
    if isinstance(optimizer, native.FTRL):
        alpha, beta = F32(optimizer.alpha), F32(optimizer.beta)
        l1, l2 = F32(optimizer.l1), F32(optimizer.l2)
        z, n = state[:dim], state[dim:]
        n_new = (n + g * g).astype(F32)
        sigma = ((np.sqrt(n_new) - np.sqrt(n)) / alpha).astype(F32)
        z = (z + (g - sigma * w)).astype(F32)
        shrunk = z - np.where(z > 0, l1, -l1).astype(F32)
        w = np.where(np.abs(z) <= l1, F32(0), -shrunk / ((beta + np.sqrt(n_new)) / alpha + l2))
        return w.astype(F32), np.concatenate([z, n_new]).astype(F32)
    raise TypeError(optimizer)


def rows_by_id(store):
    """The store's rows as a dict of numpy arrays sorted by id, for exact comparisons."""
    rows = store.to_numpy()
    order = np.argsort(rows["ids"], kind="stable")
    return {name: array[order] for name, array in rows.items()}


def assert_same_rows(a, b):
    """Bit-exact equality of two stores' rows (values, state and metadata)."""
    ra, rb = rows_by_id(a), rows_by_id(b)
    for name in ("ids", "values", "state", "update_counts", "last_steps", "last_times"):
        assert ra[name].shape == rb[name].shape, name
        assert ra[name].tobytes() == rb[name].tobytes(), f"column {name} differs"
