"""An nginx config that spreads players over several ``inference.serve`` processes (one per GPU,
or per group of CPU cores): websocket upgrade, least-connections routing (an open game is one
long connection, so the server with the fewest players gets the next), no buffering.

    python -m scripts.nginx_config --listen 127.0.0.1:8000 --backend 127.0.0.1:8001 \\
        --backend 127.0.0.1:8002 --prefix /tmp/owl-nginx
    nginx -p /tmp/owl-nginx -c nginx.conf            # nginx -p /tmp/owl-nginx -s quit stops it

Everything nginx writes (pid, error log, temporary files) stays under --prefix. docs/serve.md.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")

TEMPLATE = """# written by python -m scripts.nginx_config
worker_processes 1;
daemon {daemon};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    upstream owl_servers {{
        least_conn;
{servers}
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://owl_servers;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_read_timeout 1h;
        }}
    }}
}}
"""


def address(value: str) -> str:
    match = ADDRESS.match(value)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8001)")
    return value


def render(listen: str, backends: list[str], prefix: Path, daemon: bool = True) -> str:
    servers = "\n".join(f"        server {b};" for b in backends)
    return TEMPLATE.format(listen=listen, servers=servers, prefix=prefix.resolve(), daemon="on" if daemon else "off")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.nginx_config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=address, default="127.0.0.1:8000", help="where players connect (HOST:PORT)")
    p.add_argument("--backend", type=address, action="append", required=True,
                   help="an inference.serve process's HOST:PORT (repeat for each)")
    p.add_argument("--prefix", type=Path, required=True, help="folder for nginx.conf, its pid, log and temporary files")
    p.add_argument("--foreground", action="store_true", help="nginx stays in the foreground (daemon off)")
    args = p.parse_args(argv)
    try:
        (args.prefix / "tmp").mkdir(parents=True, exist_ok=True)
        conf = args.prefix / "nginx.conf"
        conf.write_text(render(args.listen, args.backend, args.prefix, not args.foreground))
    except OSError as exc:
        print(f"error: cannot write the config under --prefix {str(args.prefix)!r}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    print(f"wrote {conf}; start it with: nginx -p {args.prefix} -c nginx.conf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
