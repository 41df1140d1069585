"""`autotune dashboard`: optuna-dashboard on the study storage (the `dashboard` extra), on loopback by default."""

from __future__ import annotations

import argparse
import signal
import sys

from autotune.cli import command
from autotune.exceptions import AutotuneError

INSTALL_HINT = "optuna-dashboard is not installed: pip install 'ddp-autotune[dashboard]'"


class DashboardError(AutotuneError):
    """The dashboard cannot start (package missing, port taken)."""


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", help="SQLAlchemy URL (default: studies/autotune.db, where every study goes)")
    p.add_argument("--study", help="open the storage under studies/ that holds this study (the dashboard shows "
                                   "every study in it)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; the dashboard has no login)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")


@command("dashboard", help="browse the study live in optuna-dashboard (pip install 'ddp-autotune[dashboard]')",
         arguments=arguments)
def run(args) -> int:
    try:
        import optuna_dashboard
    except ImportError:
        raise DashboardError(INSTALL_HINT) from None
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from autotune.study.storage import display_url, open_storage, resolve_storage

    url = resolve_storage(args.study, args.storage, every_study=True)
    storage = open_storage(url, create=False)  # an empty new database would show an empty dashboard
    app = optuna_dashboard.wsgi(storage)

    class Server(ThreadingMixIn, WSGIServer):
        # One thread per request: the dashboard polls while the user browses; threads must not keep us alive.
        daemon_threads = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *a):
            pass

    try:
        httpd = make_server(args.host, args.port, app, server_class=Server, handler_class=QuietHandler)
    except OSError as e:
        raise DashboardError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; "
                             "pick another --port (0: any free one)") from None
    host, port = httpd.server_address[:2]
    shown = f"[{host}]" if ":" in str(host) else host
    print(f"autotune: optuna-dashboard for {display_url(url)} at http://{shown}:{port}/dashboard "
          "(Ctrl-C stops it)", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"autotune: warning: listening on {args.host}: anyone who can reach this port sees (and can edit) the "
              "studies; the dashboard has no login", file=sys.stderr, flush=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("autotune: dashboard stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        httpd.server_close()
    return 0
