"""A real PostgreSQL server for the tests, from Debian's package (``postgresql``, listed
in scripts/store-packages.txt): ``initdb`` in a temporary directory, started with
``pg_ctl`` on a free port of 127.0.0.1 (and on extra addresses a caller names, such as
the lab bridge's), with a password-authenticated role and a database of its own.

As root (CI, the lab) the server runs as the ``postgres`` user, which PostgreSQL needs:
it refuses to run as root. Off root it runs as the current user.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port

ROLE = "llmgw"
DATABASE = "llmgw"


def postgres_bin() -> Path | None:
    """The newest installed server's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(
        (Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if (Path(p) / "initdb").is_file()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return found[-1] if found else None


def unavailable() -> str | None:
    """Why no server can be started here (None: one can)."""
    if postgres_bin() is None:
        return "PostgreSQL not installed (Debian package postgresql, scripts/store-packages.txt)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no postgres user to run PostgreSQL as (Debian package postgresql)"
    return None


@dataclass
class Postgres:
    """One running server. ``url`` has no password (as the cluster file's ``gateway.store``);
    ``password`` is the role's; ``dsn`` has both (for drivers and psql)."""

    directory: Path
    port: int
    password: str
    bin: Path
    listen: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return self.url_of(DATABASE)

    @property
    def dsn(self) -> str:
        return f"postgresql://{ROLE}:{self.password}@{self.host}:{self.port}/{DATABASE}"

    def url_of(self, database: str) -> str:
        return f"postgresql://{ROLE}@{self.host}:{self.port}/{database}"

    def _as_server_user(self, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload,no-any-return]

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run ``statement`` as the superuser over the server's own Unix socket."""
        done = self._as_server_user(
            [
                str(self.bin / "psql"),
                "-X",
                "-q",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                str(self.directory),
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                database,
                "-c",
                statement,
            ]
        )
        return done.stdout

    def new_database(self) -> str:
        """A fresh, empty database owned by the role: its URL."""
        name = f"t_{secrets.token_hex(6)}"
        self.sql(f"CREATE DATABASE {name} OWNER {ROLE}")
        return self.url_of(name)

    def stop(self) -> None:
        if (self.directory / "data" / "postmaster.pid").exists():
            self._as_server_user(
                [
                    str(self.bin / "pg_ctl"),
                    "stop",
                    "-D",
                    str(self.directory / "data"),
                    "-m",
                    "immediate",
                    "-w",
                ]
            )
        shutil.rmtree(self.directory, ignore_errors=True)


def start(listen: list[str] | None = None, allow: list[str] | None = None) -> Postgres:
    """A new server with a ``llmgw`` role (random password, SCRAM over TCP) owning an
    ``llmgw`` database. ``listen``: addresses to listen on besides 127.0.0.1 (they must
    exist: the lab's bridge is up before); ``allow``: the networks (CIDR) the role may log
    in from besides 127.0.0.1, e.g. the lab's 10.213.0.0/24."""
    bin = postgres_bin()
    assert bin is not None, unavailable()
    directory = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    server = Postgres(directory, free_port(), secrets.token_urlsafe(18), bin, list(listen or []))
    data = directory / "data"
    try:
        server._as_server_user(
            [
                str(bin / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth-local=trust",  # the superuser, over the socket in the private directory
                "--auth-host=scram-sha-256",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        settings = {
            "listen_addresses": "'" + ",".join(["127.0.0.1", *server.listen]) + "'",
            "port": str(server.port),
            "unix_socket_directories": f"'{directory}'",
            "max_connections": "200",
            "fsync": "off",  # a test server: nothing to keep across a crash
            "synchronous_commit": "off",
            "full_page_writes": "off",
        }
        with (data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        with (data / "pg_hba.conf").open("a") as hba:
            hba.writelines(f"host all {ROLE} {network} scram-sha-256\n" for network in allow or [])
        server._as_server_user(
            [
                str(bin / "pg_ctl"),
                "start",
                "-D",
                str(data),
                "-w",
                "-t",
                "60",
                "-l",
                str(directory / "server.log"),
            ]
        )
        server.sql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{server.password}'")
        server.sql(f"CREATE DATABASE {DATABASE} OWNER {ROLE}")
    except BaseException:
        log = directory / "server.log"
        if log.exists():
            print(log.read_text()[-4000:])
        server.stop()
        raise
    return server
