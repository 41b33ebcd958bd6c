"""Property-based fuzzing of the gateway's HTTP API from its own OpenAPI document (schemathesis).

Valid and invalid requests, generated from the engine API's request models, to every route: no input
gets a 5xx, and every error is in the OpenAI error shape. Bounded (a fixed number of examples per
route, derandomized) so CI runs the same cases each time; the context is short so that a valid
request with a large max_tokens stays cheap.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from processes import Gateway, start_gateway

EXAMPLES = 40  # per route


@pytest.fixture(scope="module")
def gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("fuzz")
    config = (f'model = "{demo_path("fp8-block")}"\n\n'
              "[engine]\nmax_num_seqs = 4\nmax_model_len = 48\ndefault_max_tokens = 4\n\n"
              "[restart]\nstandby = 0\nqueue_timeout = 60\n")  # fmt: skip
    gw = start_gateway(root, config)
    yield gw
    gw.stop()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_input_gets_a_server_error_and_errors_are_openai_shaped(mode: schemathesis.GenerationMode,
                                                                   gateway: Gateway) -> None:  # fmt: skip
    """Valid (positive) and invalid (negative) requests to every route of the gateway's OpenAPI document."""
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions"} <= {op.path for op in operations}
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        if mode is schemathesis.GenerationMode.NEGATIVE and not len(operation.body):
            continue  # nothing in a GET without parameters can be made invalid

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=gateway.url, timeout=60)
            detail = f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} {response.text[:300]}"
            statuses[case.path, response.status_code] += 1
            assert response.status_code < 500, detail
            if response.status_code >= 400:
                error = json.loads(response.text)["error"]
                assert isinstance(error["message"], str) and error["message"], detail
                assert isinstance(error["type"], str), detail

        check()
    # The fuzzer reached the engines: some generated completions were served (positive; the schema admits
    # requests the engine refuses, such as an empty prompt), and invalid ones refused on both routes (negative).
    routes = ("/v1/completions", "/v1/chat/completions")
    if mode is schemathesis.GenerationMode.POSITIVE:
        assert sum(statuses[route, 200] for route in routes) > 0, statuses
    else:
        assert all(statuses[route, 400] > 0 for route in routes), statuses
