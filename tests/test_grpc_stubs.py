"""The gRPC stubs shipped in the package: fresh from the .proto, importable without any warning on the
protobuf and grpcio runtimes pyproject allows, and their sampling fields mirror SamplingParams."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import subprocess
import sys
import tomllib

from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "minivllm", "entrypoints", "proto")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _lower_bound(requirement: str) -> tuple[int, ...]:
    deps = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{re.escape(requirement)}\s*[><=]", d))
    return _version(re.search(r">=\s*([\d.]+)", spec).group(1))


def test_stubs_are_fresh_from_the_proto():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_proto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_stubs_import_without_warnings_in_a_fresh_interpreter():
    # -W error: protobuf warns (rather than fails) for gencode one major behind the runtime.
    code = ("from minivllm.entrypoints.proto import inference_pb2, inference_pb2_grpc\n"
            "from minivllm.entrypoints import grpc_server\n"
            "print(grpc_server.SERVICE_NAME)")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "minivllm.v1.InferenceService", r.stderr


def test_pyproject_allows_no_runtime_older_than_the_stubs():
    pb2 = open(os.path.join(PROTO_DIR, "inference_pb2.py")).read()
    gencode = _version(re.search(r"# Protobuf Python Version: ([\d.]+)", pb2).group(1))
    assert _lower_bound("protobuf") >= gencode
    grpc_stub = open(os.path.join(PROTO_DIR, "inference_pb2_grpc.py")).read()
    grpc_generated = _version(re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1))
    assert _lower_bound("grpcio") >= grpc_generated
    import google.protobuf
    import grpc

    assert _version(google.protobuf.__version__) >= gencode and _version(grpc.__version__) >= grpc_generated


def test_the_proto_ships_in_the_package():
    text = importlib.resources.files("minivllm.entrypoints.proto").joinpath("inference.proto").read_text()
    assert "service InferenceService" in text


def test_sampling_fields_mirror_sampling_params():
    single = {f.name: (f.number, f.type, f.has_presence) for f in pb.GenerateRequest.DESCRIPTOR.fields}
    batch = {f.name: (f.number, f.type, f.has_presence) for f in pb.BatchGenerateRequest.DESCRIPTOR.fields}
    scheduling = {"priority", "priority_class", "ttft_slo_ms", "timeout"}  # not sampling: the scheduler's
    own = {"prompt", "prompt_token_ids", "request_id", "prompts", "max_new_tokens"} | scheduling
    # Generate alone takes beam search (its answer carries the beams) and the prompt's logprobs.
    single_only = {"beam_width", "length_penalty", "early_stopping", "prompt_logprobs"}
    sampling = set(single) - own
    assert sampling - single_only == set(batch) - own
    for name in sampling - single_only | {"max_new_tokens"} | scheduling:
        assert single[name] == batch[name], name  # same number and type in both messages
    params = {f.name for f in dataclasses.fields(SamplingParams)}
    # Guided decoding: one SamplingParams field (a GuidedDecodingParams), spelt as vLLM's guided_* fields.
    guided = {f"guided_{k}" for k in ("json", "regex", "choice", "grammar", "json_object")}
    assert guided <= sampling
    sampling = sampling - guided | {"guided_decoding"}
    assert sampling <= params, sampling - params
    # What a single-sequence request can set: everything but n (beam_width turns beam search on).
    left_out = params - sampling - {"max_tokens"}
    assert left_out <= {"n", "use_beam_search", "output_kind"}, left_out
