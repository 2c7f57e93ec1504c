"""What a fork server imports before it forks vLLM's processes (:func:`raydp.fork_server.child_context`).

Importing this module is the work: vLLM's engine core (the ranks and their
device workers), its model executor and CPU worker, and its OpenAI front-end
(the API servers), each ~10 CPU-seconds of torch and transformers when a
process imports them itself. Every import here is one that those processes
make anyway; none of them starts a thread or touches a device.
"""

from raydp.models.vllm.config import set_process_environment

set_process_environment()  # before vLLM reads its environment, as in every vLLM process raydp starts

import vllm.entrypoints.launchers.api_server.entry  # noqa: E402  (the API servers' front-end)
import vllm.v1.engine.async_llm  # noqa: E402
import vllm.v1.engine.core  # noqa: E402  (a rank's engine core)
import vllm.v1.worker.cpu_worker  # noqa: E402, F401  (its worker, in the rank or a device worker)

import raydp.models.vllm.engine  # noqa: E402
import raydp.models.vllm.workers  # noqa: E402, F401
