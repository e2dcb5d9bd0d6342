"""Exception types the engine raises for bad input; the server maps them to HTTP 4xx."""


class GraphserveError(Exception):
    """Base class for every error graphserve raises on purpose."""


class InvalidRequestError(GraphserveError, ValueError):
    """A request the engine cannot serve as asked (bad parameter, empty prompt, ...).

    `param` names the offending field when there is one (OpenAI error body's `param`).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit in max_model_len."""


class AdapterError(InvalidRequestError):
    """A LoRA adapter graphserve cannot serve on this model: missing or malformed files, a rank over
    the maximum, a module the model lacks, a shape that does not match (the message names the file
    and the module)."""


class UnsupportedModelError(GraphserveError, ValueError):
    """The model folder holds an architecture graphserve does not implement."""


class InvalidConfigError(GraphserveError, ValueError):
    """An engine setting this model or machine cannot take (e.g. a tensor-parallel size)."""


class ModelFilesError(GraphserveError, FileNotFoundError):
    """The model folder is missing, or lacks config.json / weights / tokenizer files."""


class EngineDeadError(GraphserveError, RuntimeError):
    """The engine loop stopped after an unrecoverable error; requests cannot be served."""


class RequestFailedError(GraphserveError, RuntimeError):
    """An engine step failed while this request was in it; other requests and the engine go on."""
