"""Per-node writer accounts on the central server (schema v4, docs/central.md).

Each node (or node group) ships through its own MariaDB account.  The table `writer_nodes`
maps an account to the (cluster, node) pairs it may write; `apply_batch` first calls
`check_batch_owner`, which refuses a batch with any staged row of another cluster or node, so a
compromised node can rewrite nothing but its own records.  Inside the SQL SECURITY DEFINER
procedures CURRENT_USER() is the definer; the caller is SESSION_USER(), whose user part (before
the last '@': a host never holds one) is the account.  The definer itself (the admin that ran
`central init`) passes: it may write the tables directly anyway.

`central init --cluster C --writers HOSTLIST` registers the accounts, writes one password file
per account (mode 0600, reused when it is already there) and prints the CREATE USER statements
with the password's hash, never the password.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from slurm_gpu.errors import CentralError, InputError

MAX_ACCOUNT = 80  # MariaDB's limit on a user name (MySQL 8: 32)
ANY_NODE = "*"
# The marker of check_batch_owner's SIGNAL (MESSAGE_TEXT is at most 128 characters: the client
# composes the admin's line from it).
NOT_OWNER = "slurm_gpu_not_owner"
SIGNAL_ERRNO = 1644  # ER_SIGNAL_EXCEPTION, the server's code for a procedure's SIGNAL

_TAIL = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
TABLE_DDL = f"""CREATE TABLE IF NOT EXISTS writer_nodes (
    account VARCHAR({MAX_ACCOUNT}) NOT NULL,
    cluster VARCHAR(64) NOT NULL,
    node VARCHAR(255) NOT NULL,
    PRIMARY KEY (account, cluster, node)
) {_TAIL}"""


def check_procedure(tables: Sequence[str]) -> str:
    """check_batch_owner(b): SIGNAL when a staged row of batch b is not the caller's to write."""
    staged = " UNION ALL ".join(f"SELECT cluster, node FROM stage_{t} WHERE batch = b" for t in tables)
    return (
        "CREATE OR REPLACE PROCEDURE check_batch_owner(IN b CHAR(32)) READS SQL DATA SQL SECURITY DEFINER\n"
        "BEGIN\n"
        "  DECLARE who VARCHAR(400) DEFAULT SESSION_USER();\n"
        "  DECLARE acct VARCHAR(400);\n"
        "  DECLARE bad VARCHAR(400);\n"
        "  SET acct = LEFT(who, CHAR_LENGTH(who) - CHAR_LENGTH(SUBSTRING_INDEX(who, '@', -1)) - 1);\n"
        "  IF acct <> SUBSTRING_INDEX(CURRENT_USER(), '@', 1) THEN\n"
        f"    SET bad = (SELECT CONCAT_WS(' ', COALESCE(s.cluster, '?'), COALESCE(s.node, '?')) FROM ({staged}) AS s\n"
        "      WHERE NOT EXISTS (SELECT 1 FROM writer_nodes AS w WHERE w.account = acct AND w.cluster = s.cluster\n"
        f"                        AND w.node IN (s.node, '{ANY_NODE}')) LIMIT 1);\n"
        "    IF bad IS NOT NULL THEN\n"
        f"      SET bad = LEFT(CONCAT('{NOT_OWNER} ', bad), 128);\n"
        f"      SIGNAL SQLSTATE '45000' SET MYSQL_ERRNO = {SIGNAL_ERRNO}, MESSAGE_TEXT = bad;\n"
        "    END IF;\n"
        "  END IF;\n"
        "END")


def refusal(code: Any, text: str, account: str) -> Tuple[str, str]:
    """(message, hint) when `text` is check_batch_owner's refusal; ('', '') otherwise."""
    if code != SIGNAL_ERRNO or NOT_OWNER not in text:
        return "", ""
    parts = text.split(NOT_OWNER, 1)[1].split()
    cluster, node = (parts + ["?", "?"])[:2]
    return (f"refused the batch: account {account} may not write records of node {node} in cluster {cluster}; "
            "nothing was applied",
            "each node ships with its own writer account (central.url's user): give this node its own account, "
            f"or register it as the admin: `slurm-gpu central init --cluster {cluster} --writers {node}` "
            "(docs/central.md); the records stay in the node database")


class Writer(NamedTuple):
    account: str
    nodes: Tuple[str, ...]  # Slurm node names, or ('*',): every node of the cluster


def plan(nodes: Sequence[str], prefix: str, group: str = "") -> List[Writer]:
    """One account per node (PREFIX_NODE), or one account `group` for all of them."""
    if not nodes:
        raise InputError("--writers names no node", "e.g. --writers 'gpu[001-128]'")
    if ANY_NODE in nodes and (not group or len(nodes) > 1):
        raise InputError("--writers '*' (every node of the cluster) needs --group NAME and no other node",
                           "e.g. --writers '*' --group slurm_gpu_writer")
    writers = [Writer(group, tuple(nodes))] if group else [Writer(f"{prefix}_{n}", (n,)) for n in nodes]
    for w in writers:
        if len(w.account) > MAX_ACCOUNT or not w.account or "'" in w.account or "\\" in w.account:
            raise InputError(f"writer account {w.account!r} is not usable (quotes, backslashes, or longer than "
                               f"{MAX_ACCOUNT} characters)", "choose a shorter --writer prefix, or one --group NAME")
    return writers


def native_hash(password: str) -> str:
    """mysql_native_password's stored form: '*' + SHA1(SHA1(password)) in upper-case hex."""
    return "*" + hashlib.sha1(hashlib.sha1(password.encode("latin-1")).digest()).hexdigest().upper()


def read_password(path: str) -> str:
    """The password in `path` (first line): refused unless a regular file, not a symlink, owned by
    root or by us, and unreadable by group and others."""
    hint = f"create it with `install -m 600 -o root /dev/null {path}` and write the password into it"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CentralError(f"central.password_file {path}: no such file", hint) from None
    except OSError as e:
        why = "is a symlink" if e.errno in (40,) else (e.strerror or str(e))
        raise CentralError(f"central.password_file {path}: cannot open ({why})", hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CentralError(f"central.password_file {path}: not a regular file", hint)
        if st.st_uid not in (0, os.geteuid()):
            raise CentralError(f"central.password_file {path}: owned by uid {st.st_uid}, not root",
                               f"chown root {path} && chmod 600 {path}")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CentralError(f"central.password_file {path}: readable or writable by group/others "
                               f"(mode {stat.S_IMODE(st.st_mode):04o})", f"chmod 600 {path}")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace").splitlines()
    password = text[0].rstrip("\r") if text else ""
    if not password:
        raise CentralError(f"central.password_file {path}: empty", "write the account's password into it (one line)")
    return password


def password_for(directory: str, account: str, create: bool = True) -> str:
    """The account's password from DIR/ACCOUNT.password; a new random one written there (0600,
    never through a symlink) when the file is missing.  '' when missing and not `create`."""
    path = os.path.join(directory, f"{account}.password")
    if os.path.lexists(path):
        return read_password(path)
    if not create:
        return ""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CentralError(f"--password-dir {directory}: not a directory, or writable by group/others",
                               f"chmod 700 {directory}")
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
    except OSError as e:
        raise CentralError(f"--password-dir {directory}: cannot write {account}.password ({e.strerror or e})",
                           "run `central init` as root, with a directory only root can write") from None
    return password


def account_sql(database: str, account: str, hosts: str, password_hash: str, tables: Sequence[str]) -> List[str]:
    """CREATE USER (or set its password) and the writer's GRANTs, with the hash, never the password."""
    db = database.replace("`", "``")
    who = f"'{account}'@'{hosts}'"
    auth = f"IDENTIFIED WITH mysql_native_password AS '{password_hash}'"
    out = [f"CREATE USER IF NOT EXISTS {who} {auth};", f"ALTER USER {who} {auth};"]
    out += [f"GRANT INSERT ON `{db}`.`stage_{t}` TO {who};" for t in tables]
    out.append(f"GRANT EXECUTE ON PROCEDURE `{db}`.`apply_batch` TO {who};")
    if "remediations" in tables:  # schema v7: one GPU's remediation attempts on every node (its lemon budget)
        out.append(f"GRANT EXECUTE ON PROCEDURE `{db}`.`remediation_history` TO {who};")
    out.append(f"GRANT SELECT ON `{db}`.`meta` TO {who};")
    return out


def register(central: Any, cluster: str, writers: Sequence[Writer]) -> int:
    """Map each account to its (cluster, node)s; the number of new mappings."""
    rows = [(w.account, cluster, n) for w in writers for n in w.nodes]
    missing = unregistered(central, cluster, writers)
    central.executemany("INSERT IGNORE INTO writer_nodes (account, cluster, node) VALUES (%s, %s, %s)", rows)
    central.commit()
    return len(missing)


def unregistered(central: Any, cluster: str, writers: Sequence[Writer]) -> List[Tuple[str, str]]:
    """(account, node) pairs not yet in writer_nodes for `cluster`."""
    have = {(a, n) for a, n in central.execute("SELECT account, node FROM writer_nodes WHERE cluster = %s", (cluster,))}
    return [(w.account, n) for w in writers for n in w.nodes if (w.account, n) not in have]


def summary(writers: Sequence[Writer], directory: str) -> Dict[str, str]:
    """{account: its password file}, for the admin's message."""
    return {w.account: os.path.join(directory, f"{w.account}.password") for w in writers}
