"""An OpenAIServer on a free 127.0.0.1 port, served from a thread of the test process (the module
fixtures of the server tests use it)."""
import asyncio
import contextlib
import socket
import threading


def free_socket() -> socket.socket:
    """A bound 127.0.0.1 socket on a port the system picked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving(srv, ready_timeout: float = 300.0, grace_s: float = 5.0, sock=None, **serve_kw):
    """Serve `srv` (an OpenAIServer) until the block ends; yields its base URL (http://127.0.0.1:PORT).
    sock: the bound socket to listen on (default: `free_socket()`)."""
    from kimi_jax.entrypoints.openai.server import serve
    sock = sock or free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    ready, box = threading.Event(), {}

    def run():
        asyncio.set_event_loop(loop)

        async def main():
            box["stop"] = asyncio.Event()
            await serve(srv, sock=sock, stop=box["stop"], grace_s=grace_s, on_ready=ready.set,
                        **serve_kw)
        loop.run_until_complete(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(ready_timeout), "the server did not become ready"
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
    assert not thread.is_alive()
