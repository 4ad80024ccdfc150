"""The native module (Rust, pyo3). Use the `deepinfer` package's LLM; this is its engine."""

from typing import List, Optional, Sequence, Tuple, Union

__version__: str

class Engine:
    """A loaded model with its engine running on its own threads."""

    def __init__(
        self,
        model: Optional[str] = None,
        device: str = "cpu",
        token_budget: int = 512,
        max_running: int = 64,
        max_context: int = 65536,
        kv_dir: Optional[str] = None,
        speculative_tokens: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None: ...
    def info(self) -> str:
        """JSON text: model, builtin, note, max_context, vocab_size, speculative_tokens."""
    def encode(self, text: str) -> List[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def submit(self, prompt: Union[str, Sequence[int]], params: dict) -> List[int]:
        """Queue a prompt with every SamplingParams field in `params`; its n request ids.
        Raises ValueError naming the parameter for a bad value."""
    def submit_chat(self, body: str, n: int) -> Tuple[List[int], List[Tuple[str, float, float]]]:
        """Queue a Chat Completions body (JSON text) n times; the request ids and the sampling
        fields the model's policy overrode (field, asked, used)."""
    def wait(self, request_ids: Sequence[int]) -> List[str]:
        """Wait for the requests; their outputs as JSON text, in order. Releases the GIL;
        Ctrl-C cancels them and raises KeyboardInterrupt."""
    def next_event(self, request_id: int, timeout: float = 0.1) -> Optional[str]:
        """The next event of a request as JSON text (kind: admitted, token or done), or None
        when none came within `timeout` seconds."""
    def cancel(self, request_ids: Sequence[int]) -> None: ...
    def close(self) -> Optional[str]:
        """Finish what was submitted and stop; the engine's counters as JSON text."""
