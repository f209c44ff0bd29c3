"""What the control plane hands Dask for each run: a `Body` whose payload Dask pickles once."""

from __future__ import annotations


def test_a_body_whose_code_holds_main_is_pickled_once_by_dask_with_its_payload_beside_the_pickle():
    """A flow file's shipped source holds `__main__` (its `if __name__ == "__main__":`); Dask pickles a task again
    with cloudpickle whenever the pickle's bytes hold that, so the payload travels out of band (protocol 5)."""
    import pickle

    from distributed.protocol.serialize import deserialize, serialize, to_serialize

    from dask_gpu.worker.records import Body

    body = Body(payload=b'if __name__ == "__main__":\n    main()\n' * 100, modules=["flows.x"], devices=["0"])
    header, frames = serialize(to_serialize(body), on_error="raise")
    assert not any(b"__main__" in bytes(f) for f in frames[:1]) and len(frames) == 2
    assert deserialize(header, frames) == body
    for protocol in (2, 4, 5):
        assert pickle.loads(pickle.dumps(body, protocol=protocol)) == body
