#!/usr/bin/env python3
# The container recipes (k8s/image), which cannot be built here (no container
# engine): hadolint finds nothing; every COPY source exists and passes the
# .dockerignore; the build stage's copy of the sources configures with the
# Dockerfile's own CMake flags (so a new top-level folder or script the build
# needs cannot be forgotten); everything the manifests run from
# /opt/tessera/bin is installed or copied there; user, home and ssh port agree
# with the manifests' checks; the Debian package names exist in Debian 12; the
# shell scripts parse.
import re
import shlex
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

import k8s_test_support as support
from k8s_test_support import k8scheck

REPO = support.REPO
IMAGE = REPO / "k8s" / "image"
DOCKERFILES = [IMAGE / "Dockerfile", IMAGE / "Dockerfile.cpu"]
HADOLINT = k8scheck.find_hadolint()
if HADOLINT is None:
    support.missing("no hadolint: scripts/install-deps.sh installs it into /opt/tessera-tools (or set TESSERA_HADOLINT)")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                result.append((word.upper(), rest.strip()))
            current = ""
    return result


def copies(dockerfile: Path) -> list[tuple[list[str], str, dict]]:
    """COPY instructions: (sources, destination, {--flag: value})."""
    result = []
    for word, rest in instructions(dockerfile):
        if word != "COPY":
            continue
        parts = shlex.split(rest)
        flags = {p.split("=")[0]: p.partition("=")[2] for p in parts if p.startswith("--")}
        paths = [p for p in parts if not p.startswith("--")]
        result.append((paths[:-1], paths[-1], flags))
    return result


def build_stage_cmake_flags(dockerfile: Path) -> list[str]:
    for word, rest in instructions(dockerfile):
        if word == "RUN" and rest.startswith("cmake -S . -B /build"):
            configure = rest.split("&&")[0]
            return [f for f in shlex.split(configure) if f.startswith("-D")]
    raise AssertionError(f"{dockerfile}: no `cmake -S . -B /build` step")


class Lint(unittest.TestCase):
    def test_hadolint_finds_nothing(self):
        result = subprocess.run([HADOLINT, "--no-color", "--config", str(IMAGE / ".hadolint.yaml"),
                                 *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
        self.assertEqual((result.returncode, result.stdout.strip()), (0, ""), result.stdout + result.stderr)

    def test_hadolint_is_not_blind(self):
        with tempfile.NamedTemporaryFile("w", suffix="Dockerfile") as bad:
            bad.write("FROM debian\nRUN cd /tmp && apt-get install curl\n")
            bad.flush()
            result = subprocess.run([HADOLINT, "--no-color", "--config", str(IMAGE / ".hadolint.yaml"), bad.name],
                                    capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("DL3006", result.stdout)  # untagged image

    def test_scripts_parse(self):
        for shell, script in (("bash", "tessera-mpirun"), ("sh", "tessera-sshd"), ("sh", "setup-runtime.sh")):
            with self.subTest(script=script):
                result = subprocess.run([shell, "-n", str(IMAGE / script)], capture_output=True, text=True)
                self.assertEqual(result.returncode, 0, result.stderr)


class Sources(unittest.TestCase):
    def test_copy_sources_exist_and_pass_the_dockerignore(self):
        for dockerfile in DOCKERFILES:
            ignore = Path(f"{dockerfile}.dockerignore").read_text().split("\n")
            allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
            self.assertIn("*", ignore, "the .dockerignore starts by excluding everything")
            for sources, _, flags in copies(dockerfile):
                if "--from" in flags:
                    continue
                for source in sources:
                    with self.subTest(dockerfile=dockerfile.name, source=source):
                        path = source.rstrip("/") if source != "." else "."
                        self.assertTrue((REPO / path).exists(), f"{source} does not exist in the repository")
                        self.assertTrue(any(path == a or path.startswith(a + "/") for a in allowed),
                                        f"{source} is excluded by {dockerfile.name}.dockerignore")

    def test_build_stage_configures_with_only_the_copied_sources(self):
        """Copies what the build stage COPYs into a fresh directory, as Docker would,
        and runs the Dockerfile's CMake configure step there (CPU backend: no CUDA
        here; the CUDA image's sources are the same)."""
        if shutil.which("cmake") is None:
            support.missing("cmake")
        dockerfile = IMAGE / "Dockerfile.cpu"
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp, "src")
            src.mkdir()
            for sources, destination, flags in copies(dockerfile):
                # The build stage's sources land in its WORKDIR (relative destinations); the
                # runtime stage's files go to absolute paths.
                if "--from" in flags or destination.startswith("/"):
                    continue
                for source in sources:
                    target = src / (destination if destination not in ("./", ".") else Path(source).name)
                    if (REPO / source).is_dir():
                        shutil.copytree(REPO / source, target)
                    else:
                        shutil.copy2(REPO / source, target)
            flags = build_stage_cmake_flags(dockerfile)
            self.assertIn("-DTESSERA_CUDA=OFF", flags)
            self.assertIn("-DCMAKE_INSTALL_PREFIX=/opt/tessera", flags)
            result = subprocess.run(["cmake", "-S", str(src), "-B", f"{tmp}/build", "-G", "Ninja", *flags],
                                    capture_output=True, text=True, timeout=300)
            self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-3000:])
            # What `cmake --install` puts into /opt/tessera/bin.
            installed = set()
            for script in Path(tmp, "build").rglob("cmake_install.cmake"):
                for destination, files in re.findall(
                        r'file\(INSTALL DESTINATION "([^"]+)" TYPE (?:EXECUTABLE|PROGRAM|FILE) FILES ([^)]*)\)',
                        script.read_text()):
                    if destination == "${CMAKE_INSTALL_PREFIX}/bin":
                        installed |= {Path(f.strip('"')).name for f in files.split()}
        copied = {Path(s).name for sources, destination, flags in copies(IMAGE / "Dockerfile.cpu")
                  if destination.rstrip("/") == k8scheck.IMAGE_BIN for s in sources}
        needed = {Path(p).name for p in (k8scheck.RANK_WRAPPER, k8scheck.TESSERA_BINARY, k8scheck.LAUNCH_WRAPPER,
                                         k8scheck.SSHD_WRAPPER)}
        self.assertEqual(needed - installed - copied, set(), f"installed {installed}, copied {copied}")

    def test_both_images_copy_the_same_sources_and_scripts(self):
        def sources(dockerfile):
            return sorted((tuple(s), d) for s, d, f in copies(dockerfile) if "--from" not in f)
        self.assertEqual(sources(DOCKERFILES[0]), sources(DOCKERFILES[1]))


class Conventions(unittest.TestCase):
    def test_user_home_and_port_agree_with_the_manifest_checks(self):
        setup = (IMAGE / "setup-runtime.sh").read_text()
        self.assertRegex(setup, rf"useradd --uid {k8scheck.IMAGE_USER_UID} .*mpiuser")
        self.assertEqual(k8scheck.IMAGE_USER_HOME, "/home/mpiuser")
        self.assertIn(f"Port {k8scheck.SSH_PORT}", setup)
        self.assertIn(f"TESSERA_SSH_PORT:-{k8scheck.SSH_PORT}", (IMAGE / "tessera-sshd").read_text())
        self.assertIn(f"TESSERA_SSH_PORT:-{k8scheck.SSH_PORT}", (IMAGE / "tessera-mpirun").read_text())
        for dockerfile in DOCKERFILES:
            with self.subTest(dockerfile=dockerfile.name):
                steps = instructions(dockerfile)
                self.assertEqual([r for w, r in steps if w == "USER"][-1], str(k8scheck.IMAGE_USER_UID))
                env = " ".join(r for w, r in steps if w == "ENV")
                self.assertIn(f"PATH={k8scheck.IMAGE_BIN}:", env)
                self.assertIn("LD_LIBRARY_PATH=/opt/tessera/lib", env)  # forwarded with -x by the launcher

    def test_debian_package_names_exist(self):
        """The Debian 12 packages the images install (this machine is Debian 12)."""
        names = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", re.search(
            r"apt-get install -y --no-install-recommends \\\n(.*?)\n[a-z]", (IMAGE / "setup-runtime.sh").read_text(),
            re.S).group(1)))
        for word, rest in instructions(IMAGE / "Dockerfile.cpu"):
            if word == "RUN" and "apt-get install" in rest:
                names |= set(re.findall(r"[a-z0-9][a-z0-9.+-]+", rest.split("--no-install-recommends")[1]
                                        .split("&&")[0]))
        names.discard("\\")
        result = subprocess.run(["apt-cache", "show", "--no-all-versions", *sorted(names)], capture_output=True,
                                text=True, timeout=60)
        if "No packages found" in result.stderr and all(f"Package: {n}\n" not in result.stdout for n in names):
            support.missing("apt-cache knows no package (run apt-get update)")
        found = set(re.findall(r"^Package: (\S+)$", result.stdout, re.M))
        self.assertEqual(names - found, set(), result.stderr)


if __name__ == "__main__":
    support.run_tests()
