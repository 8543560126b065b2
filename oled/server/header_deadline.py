"""A deadline for a request's line and headers, which uvicorn does not have.

uvicorn closes a keep-alive connection that stays idle between requests (`timeout_keep_alive`), but a client that
opens a connection and sends its headers slowly, or never finishes them, holds it for as long as it likes: the
request has not reached the app, so the app's body deadline (guards.py) cannot see it. This protocol is uvicorn's
h11 protocol with one timer per connection: armed when the connection opens and whenever bytes of a new request
arrive, cancelled as soon as the request's headers are complete; when it fires, the client gets HTTP 408 and the
connection is closed.
"""
from __future__ import annotations

HEADER_TIMEOUT_S = 10.0     # the default time a request's line and headers may take to arrive


def header_deadline_protocol(seconds: float):
    """uvicorn's H11Protocol with a header deadline of `seconds` (pass the class as uvicorn.Config(http=...))."""
    import h11  # optional: the serve extra
    from uvicorn.protocols.http.h11_impl import H11Protocol  # optional: the serve extra

    class HeaderDeadlineProtocol(H11Protocol):
        header_timeout_s = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:      # bytes of a request whose headers are not complete yet
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            # an idle keep-alive connection is uvicorn's to close (timeout_keep_alive); this one is mid-request
            if self.conn.our_state is h11.IDLE:
                body = b'{"error":{"message":"the request headers did not arrive in time","type":' \
                       b'"invalid_request_error","param":null,"code":"request_timeout"}}'
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                                     + b"\r\n\r\n" + body)
            self.transport.close()

    return HeaderDeadlineProtocol
