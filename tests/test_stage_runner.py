"""Service.run, the one stage runner both protocols call: readiness, arrivals, limits, decoding, the queue."""
from __future__ import annotations

import pytest
import torch

from app.engine.service import Job, Service
from app.errors import BadRequest, InvalidImage, NotReady, TooManyImages
from tests.imaging import BLUE, RED, image_bytes


def test_images_are_decoded_queued_and_answered_in_order(service: Service) -> None:
    served = service.run(lambda: Job("parsed", 5.0, images=[image_bytes(RED), image_bytes(BLUE)]))
    assert served.parsed == "parsed"
    assert served.probabilities().argmax(dim=1).tolist() == [0, 2]  # red, blue
    assert served.decode_s > 0 and all(r.batch_size >= 1 for r in served.results)


def test_preprocessed_tensors_skip_decoding(service: Service) -> None:
    red = service.preprocess(image_bytes(RED))
    served = service.run(lambda: Job(None, 5.0, tensors=[red, red]))
    assert served.decode_s == 0.0 and served.probabilities().argmax(dim=1).tolist() == [0, 0]


def test_the_request_counts_as_arriving_while_it_reads_and_decodes(service: Service) -> None:
    seen: list[int] = []

    def read() -> Job[None]:
        seen.append(service.arrivals.count())
        return Job(None, 5.0, images=[image_bytes(RED)])

    service.run(read)
    assert seen == [1] and service.arrivals.count() == 0


def test_a_lone_request_takes_the_inline_path(service: Service) -> None:
    # What a route that forgot to report its arrival lost: every batch waited max_wait_ms on the worker thread.
    before = service.batcher.batches_inline
    service.run(lambda: Job(None, 5.0, images=[image_bytes(RED)]))
    assert service.batcher.batches_inline == before + 1


def test_a_failing_read_leaves_no_arrival_behind(service: Service) -> None:
    def read() -> Job[None]:
        raise BadRequest("bad field")

    with pytest.raises(BadRequest):
        service.run(read)
    with pytest.raises(InvalidImage):
        service.run(lambda: Job(None, 5.0, images=[b"not an image"]))
    assert service.arrivals.count() == 0


@pytest.mark.parametrize("images, tensors, error", [
    ([], [], BadRequest),
    ([b"x"], [torch.zeros(3, 8, 8)], BadRequest),
    ([image_bytes(RED)] * 5, [], TooManyImages),  # max_images is 4: the runner checks even if a protocol did not
])
def test_the_runner_enforces_the_input_rules(service: Service, images: list[bytes], tensors: list[torch.Tensor],
                                             error: type[Exception]) -> None:
    with pytest.raises(error):
        service.run(lambda: Job(None, 5.0, images=images, tensors=tensors))


def test_not_ready_is_refused_before_the_body_is_read(service: Service) -> None:
    service.begin_drain()
    read_called: list[bool] = []

    def read() -> Job[None]:
        read_called.append(True)
        return Job(None, 5.0, images=[image_bytes(RED)])

    with pytest.raises(NotReady):
        service.run(read)
    assert not read_called
