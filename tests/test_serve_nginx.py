"""Scale-out on one machine with parts users already run: two servers behind Debian's nginx
(websocket upgrade, least-connections routing, config from scripts/nginx_config.py), four
players spread over them."""
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from .conftest import run_main
from .servers import Player, Server

NGINX = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx (apt-get install nginx)")
def test_four_players_spread_over_two_servers_behind_nginx(tmp_path):
    # (a few steps a second: the test needs a few frames, and a server stepping as fast as it goes
    # takes cores from the tests beside it for as long as they slow it down)
    with Server("--max-sessions", 2, "--max-fps", 4) as a, Server("--max-sessions", 2, "--max-fps", 4) as b:
        port = free_port()
        backends = [s.url.removeprefix("http://") for s in (a, b)]
        r = run_main("scripts.nginx_config", ["--listen", f"127.0.0.1:{port}", "--prefix", tmp_path / "nginx",
                                              "--foreground", *[x for bk in backends for x in ("--backend", bk)]])
        assert r.returncode == 0, r.stderr
        nginx = subprocess.Popen([NGINX, "-p", tmp_path / "nginx", "-c", "nginx.conf"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        players = []
        try:
            front = f"http://127.0.0.1:{port}"
            for _ in range(100):  # nginx is listening once the page comes through it
                try:
                    with urllib.request.urlopen(front + "/", timeout=5) as page:
                        assert b"<canvas" in page.read()
                    break
                except OSError:
                    assert nginx.poll() is None, nginx.stdout.read()
                    time.sleep(0.1)
            for i in range(4):
                players.append(Player(f"ws://127.0.0.1:{port}/ws", seed=i))
                assert players[-1].welcome["type"] == "welcome", players[-1].welcome
                players[-1].next_frame()
            assert [a.health()["sessions"], b.health()["sessions"]] == [2, 2]
            for p in players:  # every player keeps getting frames through nginx
                first = p.next_frame()[0]
                assert p.next_frame()[0] > first
        finally:
            for p in players:
                p.close()
            nginx.terminate()
            nginx.wait(10)
