from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardRequest(_message.Message):
    __slots__ = ("run_id", "microbatch_id", "stage", "wire", "tokens", "targets", "evaluate", "work_key", "round_trip_s", "full_precision")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    WORK_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    FULL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    microbatch_id: str
    stage: int
    wire: bytes
    tokens: bytes
    targets: bytes
    evaluate: bool
    work_key: str
    round_trip_s: float
    full_precision: bool
    def __init__(self, run_id: _Optional[str] = ..., microbatch_id: _Optional[str] = ..., stage: _Optional[int] = ..., wire: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., targets: _Optional[bytes] = ..., evaluate: _Optional[bool] = ..., work_key: _Optional[str] = ..., round_trip_s: _Optional[float] = ..., full_precision: _Optional[bool] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("wire", "loss", "input_grad", "step", "queued_s", "compute_s", "repeat", "credits", "in_flight_credits", "weights_version", "full_precision", "callers")
    WIRE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    INPUT_GRAD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    CALLERS_FIELD_NUMBER: _ClassVar[int]
    wire: bytes
    loss: float
    input_grad: bytes
    step: int
    queued_s: float
    compute_s: float
    repeat: bool
    credits: int
    in_flight_credits: int
    weights_version: int
    full_precision: bool
    callers: int
    def __init__(self, wire: _Optional[bytes] = ..., loss: _Optional[float] = ..., input_grad: _Optional[bytes] = ..., step: _Optional[int] = ..., queued_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., repeat: _Optional[bool] = ..., credits: _Optional[int] = ..., in_flight_credits: _Optional[int] = ..., weights_version: _Optional[int] = ..., full_precision: _Optional[bool] = ..., callers: _Optional[int] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("run_id", "microbatch_id", "stage", "output_grad", "round_trip_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_GRAD_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    microbatch_id: str
    stage: int
    output_grad: bytes
    round_trip_s: float
    def __init__(self, run_id: _Optional[str] = ..., microbatch_id: _Optional[str] = ..., stage: _Optional[int] = ..., output_grad: _Optional[bytes] = ..., round_trip_s: _Optional[float] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("input_grad", "step", "queued_s", "compute_s", "repeat", "credits", "in_flight_credits", "weights_version", "callers")
    INPUT_GRAD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLERS_FIELD_NUMBER: _ClassVar[int]
    input_grad: bytes
    step: int
    queued_s: float
    compute_s: float
    repeat: bool
    credits: int
    in_flight_credits: int
    weights_version: int
    callers: int
    def __init__(self, input_grad: _Optional[bytes] = ..., step: _Optional[int] = ..., queued_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., repeat: _Optional[bool] = ..., credits: _Optional[int] = ..., in_flight_credits: _Optional[int] = ..., weights_version: _Optional[int] = ..., callers: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatches", "step", "completed_batch", "replicas")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_BATCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatches: int
    step: int
    completed_batch: int
    replicas: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatches: _Optional[int] = ..., step: _Optional[int] = ..., completed_batch: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "grad_norm", "lr", "skipped", "accumulated")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    step: int
    grad_norm: float
    lr: float
    skipped: bool
    accumulated: int
    def __init__(self, step: _Optional[int] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., skipped: _Optional[bool] = ..., accumulated: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("run_id", "microbatch_id", "stage")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    microbatch_id: str
    stage: int
    def __init__(self, run_id: _Optional[str] = ..., microbatch_id: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("reverted", "outcome")
    REVERTED_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    reverted: bool
    outcome: str
    def __init__(self, reverted: _Optional[bool] = ..., outcome: _Optional[str] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("run_id", "stage", "session_id", "position", "tokens", "wire", "max_tokens", "score", "top_logprobs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    session_id: str
    position: int
    tokens: bytes
    wire: bytes
    max_tokens: int
    score: bool
    top_logprobs: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., session_id: _Optional[str] = ..., position: _Optional[int] = ..., tokens: _Optional[bytes] = ..., wire: _Optional[bytes] = ..., max_tokens: _Optional[int] = ..., score: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class InferReply(_message.Message):
    __slots__ = ("wire", "logits", "length", "step", "session_step", "queued_s", "compute_s", "token_logprobs", "top_logprobs", "top_ids")
    WIRE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    wire: bytes
    logits: bytes
    length: int
    step: int
    session_step: int
    queued_s: float
    compute_s: float
    token_logprobs: bytes
    top_logprobs: bytes
    top_ids: bytes
    def __init__(self, wire: _Optional[bytes] = ..., logits: _Optional[bytes] = ..., length: _Optional[int] = ..., step: _Optional[int] = ..., session_step: _Optional[int] = ..., queued_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., token_logprobs: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., top_ids: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("run_id", "stage", "session_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    session_id: str
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id", "stage", "snapshot_id", "offset", "sketch_seed", "sketch_size")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    snapshot_id: str
    offset: int
    sketch_seed: int
    sketch_size: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., offset: _Optional[int] = ..., sketch_seed: _Optional[int] = ..., sketch_size: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("snapshot_id", "offset", "data", "total_bytes", "sha256", "step")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    offset: int
    data: bytes
    total_bytes: int
    sha256: str
    step: int
    def __init__(self, snapshot_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ReceiptDelivery(_message.Message):
    __slots__ = ("receipt",)
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt: str
    def __init__(self, receipt: _Optional[str] = ...) -> None: ...

class ReceiptKept(_message.Message):
    __slots__ = ("receipts", "microbatches", "tokens")
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    receipts: int
    microbatches: int
    tokens: int
    def __init__(self, receipts: _Optional[int] = ..., microbatches: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class AttestationDelivery(_message.Message):
    __slots__ = ("attestation",)
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    attestation: str
    def __init__(self, attestation: _Optional[str] = ...) -> None: ...

class AttestationKept(_message.Message):
    __slots__ = ("rounds", "attestations", "attesters")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ATTESTATIONS_FIELD_NUMBER: _ClassVar[int]
    ATTESTERS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    attestations: int
    attesters: int
    def __init__(self, rounds: _Optional[int] = ..., attestations: _Optional[int] = ..., attesters: _Optional[int] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("ping", "upload", "upload_done", "received", "download", "payload")
    PING_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_DONE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ping: int
    upload: bytes
    upload_done: bool
    received: int
    download: int
    payload: bytes
    def __init__(self, ping: _Optional[int] = ..., upload: _Optional[bytes] = ..., upload_done: _Optional[bool] = ..., received: _Optional[int] = ..., download: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("run_id", "stage", "n_stages", "step", "phase", "load", "capacity", "stashed", "synchronous", "throughput", "sessions", "session_capacity", "credits", "in_flight_credits")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    N_STAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STASHED_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    n_stages: int
    step: int
    phase: str
    load: int
    capacity: int
    stashed: int
    synchronous: bool
    throughput: float
    sessions: int
    session_capacity: int
    credits: int
    in_flight_credits: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., n_stages: _Optional[int] = ..., step: _Optional[int] = ..., phase: _Optional[str] = ..., load: _Optional[int] = ..., capacity: _Optional[int] = ..., stashed: _Optional[int] = ..., synchronous: _Optional[bool] = ..., throughput: _Optional[float] = ..., sessions: _Optional[int] = ..., session_capacity: _Optional[int] = ..., credits: _Optional[int] = ..., in_flight_credits: _Optional[int] = ...) -> None: ...
